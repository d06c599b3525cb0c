"""The trees a heads folder carries: `trees.json`, one Medusa tree per backend and batch size, written by
scripts/build_tree.py; the file and how a backend and batch size resolve to an entry (`resolve_tree`) are in
docs/design.md, "The tree belongs to the heads" and "Dynamic trees"."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Sequence

from medusa_jax.trees.tree import DEFAULT_TREE, DynamicTree, TreeError, build_tree

FILE_NAME = "trees.json"
FORMAT = "medusa-jax-trees"
VERSION = 1
ACCELERATOR_FALLBACK = {"gpu": ("tpu", "cpu"), "tpu": ("gpu", "cpu")}  # cpu: no fallback (plain)

Paths = tuple[tuple[int, ...], ...]


class TreesFileError(TreeError):
    """An invalid trees.json."""


@dataclasses.dataclass(frozen=True)
class HeadsTrees:
    """A parsed trees.json: backend -> ((batch size, paths), ...) sorted by batch; `()` paths = no tree, a
    DynamicTree in place of paths = a dynamic tree.
    Hashable (it rides on the heads module, a static part of jitted calls)."""

    origin: str  # the file, for messages (as given, e.g. relative)
    trees: tuple[tuple[str, tuple[tuple[int, "Paths | DynamicTree"], ...]], ...]
    text: str = dataclasses.field(default="", repr=False)  # the whole document (its "built" metadata)

    def backends(self) -> list[str]:
        return [backend for backend, _ in self.trees]

    def batches(self, backend: str) -> "dict[int, Paths | DynamicTree]":
        return dict(dict(self.trees).get(backend, ()))

    def built(self, backend: str) -> dict:
        """How the backend's entry was made (build_tree's measurements), {} if not recorded."""
        return json.loads(self.text).get("built", {}).get(backend, {}) if self.text else {}

    def check_heads(self, num_heads: int, head_vocab_size: int) -> None:
        """Every tree fits heads with num_heads heads and head_vocab_size candidates per head."""
        for backend, batches in self.trees:
            for batch, paths in batches:
                if isinstance(paths, DynamicTree):
                    try:
                        paths.check(num_heads, head_vocab_size)
                    except TreeError as e:
                        raise TreesFileError(f"{self.origin}: {backend} batch {batch}: {e}") from None
                elif paths:
                    _checked(paths, f"{self.origin}: {backend} batch {batch}", num_heads=num_heads,
                             max_top_k=head_vocab_size)


@dataclasses.dataclass(frozen=True)
class TreeResolution:
    """The tree to decode with and why. paths None: decode plainly; preset: a preset name instead of paths;
    dynamic: a dynamic tree instead of paths."""

    paths: Paths | None
    note: str
    preset: str | None = None
    backend: str | None = None  # the trees.json entry used
    batch: int | None = None
    dynamic: DynamicTree | None = None

    @property
    def plain(self) -> bool:
        return self.paths is None and self.preset is None and self.dynamic is None


def _checked(paths, name: str, **limits):
    try:
        return build_tree(paths, name=name, **limits)
    except TreeError as e:
        raise TreesFileError(str(e)) from None


def trees_of(heads) -> HeadsTrees | None:
    """The trees `heads.load.load_heads` attached to loaded heads (None: the folder had no trees.json)."""
    return getattr(heads, "trees", None)


def attach_trees(heads, trees: HeadsTrees | None):
    """Checks the trees against the heads and attaches them (`heads.trees`); returns the heads."""
    if trees is not None:  # heads without trees keep their module graph as it was
        trees.check_heads(heads.config.num_heads, heads.config.head_vocab_size)
        heads.trees = trees
    return heads


def parse_trees(document, origin: str) -> HeadsTrees:
    """Validates a trees.json document (already parsed JSON) and returns it as HeadsTrees."""
    if not isinstance(document, dict) or document.get("format") != FORMAT:
        raise TreesFileError(f"{origin}: not a trees file (expected a JSON object with \"format\": \"{FORMAT}\")")
    if document.get("version") != VERSION:
        raise TreesFileError(f"{origin}: version {document.get('version')!r} is not supported (expected {VERSION})")
    trees = document.get("trees")
    if not isinstance(trees, dict) or not trees:
        raise TreesFileError(f"{origin}: \"trees\" must map backends (cpu, gpu, tpu) to {{batch size: paths}}")
    out = []
    for backend in sorted(trees):
        batches = trees[backend]
        if not isinstance(batches, dict) or not batches:
            raise TreesFileError(f"{origin}: trees[{backend!r}] must map batch sizes to medusa_choices lists")
        entries = []
        for key, paths in batches.items():
            batch = int(key) if key.isdecimal() else 0
            if batch < 1 or str(batch) != str(key):
                raise TreesFileError(f"{origin}: trees[{backend!r}] has batch size {key!r}; batch sizes are "
                                     f"integers >= 1")
            if isinstance(paths, dict):
                try:
                    entries.append((batch, DynamicTree.from_json(paths, f"{origin}: trees[{backend!r}][{key!r}]")))
                except TreeError as e:
                    raise TreesFileError(str(e)) from None
                continue
            if not isinstance(paths, list):
                raise TreesFileError(f"{origin}: trees[{backend!r}][{key!r}] must be a list of paths, a dynamic "
                                     f"tree {{\"dynamic\": {{\"nodes\": N}}}}, or [] for "
                                     f"plain decoding")
            tree = _checked(paths, f"{origin}: trees[{backend!r}][{key!r}]") if paths else None
            entries.append((batch, tree.paths if tree else ()))
        out.append((backend, tuple(sorted(entries))))
    return HeadsTrees(origin, tuple(out), json.dumps(document, sort_keys=True))


def read_trees(folder: str | os.PathLike) -> HeadsTrees | None:
    """The trees of a heads folder, or None when it has no trees.json. Raises TreesFileError if invalid."""
    return read_trees_file(Path(folder) / FILE_NAME)


def read_trees_file(path: str | os.PathLike) -> HeadsTrees | None:
    """A trees file, or None when there is none. Raises TreesFileError if invalid."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise TreesFileError(f"{path}: not valid JSON ({e})") from None
    return parse_trees(document, str(path))


def trees_document(existing: HeadsTrees | None, backend: str,
                   batches: "dict[int, Sequence[Sequence[int]] | DynamicTree]", built: dict) -> dict:
    """The trees.json content after replacing `backend`'s entry (other backends are kept); a batch's entry is a
    list of paths ([] for plain decoding) or a DynamicTree."""
    document = json.loads(existing.text) if existing is not None and existing.text else {}
    trees = dict(document.get("trees", {}))
    trees[backend] = {str(b): batches[b].to_json() if isinstance(batches[b], DynamicTree)
                      else [list(p) for p in batches[b]] for b in sorted(batches)}
    all_built = dict(document.get("built", {}))
    all_built[backend] = built
    document = {"format": FORMAT, "version": VERSION, "trees": trees, "built": all_built}
    parse_trees(document, "the new trees.json")  # never write what cannot be read back
    return document


def resolve_tree(trees: HeadsTrees | None, backend: str, batch_size: int) -> TreeResolution:
    """The heads' tree for this backend and batch size: the backend's entry, else (an accelerator) the other
    accelerator's, then the cpu's (a cpu without one decodes plainly); in it, the entry for batch_size, else the
    nearest smaller measured batch, else the smallest; heads without trees.json: the preset DEFAULT_TREE."""
    if trees is None:
        return TreeResolution(None, f"preset {DEFAULT_TREE} (the heads carry no {FILE_NAME}; build one with "
                                    f"scripts/build_tree.py)", preset=DEFAULT_TREE)
    chosen = backend if backend in trees.backends() else next(
        (b for b in ACCELERATOR_FALLBACK.get(backend, ()) if b in trees.backends()), None)
    if chosen is None:
        return TreeResolution(None, f"plain decoding: {trees.origin} has no tree for {backend} (only "
                                    f"{', '.join(trees.backends())}); build one with scripts/build_tree.py, or "
                                    f"pass a tree")
    batches = trees.batches(chosen)
    batch = max((b for b in batches if b <= batch_size), default=min(batches))
    where = f"{chosen} batch {batch}" + ("" if chosen == backend else f", used for {backend}") + (
        "" if batch == batch_size else f", used for batch {batch_size}")
    paths = batches[batch]
    if isinstance(paths, DynamicTree):
        return TreeResolution(None, f"the heads' dynamic tree {paths.name} ({where})", backend=chosen, batch=batch,
                              dynamic=paths)
    if not paths:
        return TreeResolution(None, f"plain decoding: the heads' trees say no tree pays ({where})",
                              backend=chosen, batch=batch)
    return TreeResolution(paths, f"the heads' tree of {len(paths)} nodes ({where})", backend=chosen, batch=batch)
