"""MT-Bench decoding benchmark: plain vs Medusa (and transformers' generate), greedy, interleaved question by
question; the figures' definitions are in docs/modules.md."""

from __future__ import annotations

import dataclasses
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable, Sequence

import jax
import numpy as np

from medusa_jax.paths import portable_path
from medusa_jax.settings import at_least, check_settings, each_or_none, setting
from medusa_jax.trees.tree import MC_SIM_7B_63, PRESETS, DynamicTree, TreeBuffers, TreeError, build_tree, load_tree
from medusa_jax.trees.trees_file import HeadsTrees, resolve_tree, trees_of
from medusa_jax.trees.policy import step_cost as whole_step
from medusa_jax.trees.policy.choose import ChosenTree, choose_tree
from medusa_jax.inference.api import generate, generate_medusa
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up
from medusa_jax.inference.sharded import ShardedModel
from medusa_jax.bench import step_cost
from medusa_jax.inference.loaded_model import LoadedModel
from medusa_jax.bench.decode_benchmark import TorchGenerate
from medusa_jax.mtbench import MTBenchQuestion

METHODS = ("plain", "medusa", "hf")


@dataclasses.dataclass(frozen=True)
class BenchmarkConfig:
    max_new_tokens: int = setting(256, at_least(1))
    batch_size: int = setting(1, at_least(1))  # rows per call in the main (interleaved, per-question) run
    tree: str | None = None  # preset name or tree JSON file; None: the heads' own tree per batch size
    hf: bool = False  # also time transformers' PyTorch generate
    hf_threads: int = setting(1, at_least(0))  # torch intra-op threads (0: torch's default)
    batched_sizes: tuple[int, ...] = setting((4, 8), each_or_none(at_least(1)))  # more sizes for the throughput table
    sweep_sizes: tuple[int, ...] = setting((4, 8, 16, 32, 64), each_or_none(at_least(1)))  # tree sizes for the sweep
    sweep_questions: int = setting(2, at_least(0))  # questions per sweep size
    profile: bool = True  # time each piece of a Medusa step (step_cost.piece_seconds) at batch 1
    calibration: str | None = None  # tree None: how the heads' own tree is chosen (`inference.calibration`)

    def __post_init__(self):
        if self.tree is not None and self.calibration is not None:
            raise ValueError(f"--calibration {self.calibration} chooses the heads' own tree, so it does nothing with "
                             f"--tree {self.tree}: drop one of them")
        check_settings(self)


@dataclasses.dataclass
class Timed:
    token_ids: list[list[int]]  # per row
    steps: list[int]
    seconds: float
    accept_lengths: list[list[int]] | None = None

    @property
    def tokens(self) -> int:
        return sum(len(t) for t in self.token_ids)


class Runner:
    """Runs each method through its public API, compiling (one untimed call) before the first timed call
    of every new (method, prompt bucket, batch size, tree)."""

    def __init__(self, loaded: LoadedModel, max_new_tokens: int, hf: bool, hf_threads: int = 1):
        self.loaded, self.max_new_tokens = loaded, max_new_tokens
        self._warm: set = set()
        self.compile_seconds: dict[str, float] = defaultdict(float)
        self.hf_threads = hf_threads
        self.hf_model = TorchGenerate(loaded.folder) if hf else None

    def _call(self, method: str, prompts: Sequence[Sequence[int]], batch: int, tree: TreeBuffers | None) -> Timed:
        lm = self.loaded
        start = time.perf_counter()
        if method == "hf":
            out = [self.hf_model(p, self.max_new_tokens, self.hf_threads, lm.eos_ids, lm.pad_id) for p in prompts]
            return Timed(out, [len(t) for t in out], time.perf_counter() - start)
        if method == "plain" or tree is None:  # no tree pays: Medusa decodes plainly
            res = generate(lm.base, prompts, max_new_tokens=self.max_new_tokens, eos_ids=lm.eos_ids,
                           pad_id=lm.pad_id, batch_size=batch)
        else:
            res = generate_medusa(lm.base, lm.heads, prompts, tree=tree, max_new_tokens=self.max_new_tokens,
                                  eos_ids=lm.eos_ids, pad_id=lm.pad_id, batch_size=batch)
        seconds = time.perf_counter() - start
        return Timed([r.token_ids for r in res], [r.steps for r in res], seconds,
                     [r.accept_lengths or [] for r in res] if method == "medusa" else None)

    def run(self, method: str, prompts: Sequence[Sequence[int]], batch: int, tree: TreeBuffers | None = None) -> Timed:
        width = round_up(max(len(p) for p in prompts), PROMPT_BUCKET)
        key = (method, width if method != "hf" else 0, batch, tree)
        if key not in self._warm:
            start = time.perf_counter()
            self._call(method, prompts, batch, tree)
            self.compile_seconds[method] += time.perf_counter() - start
            self._warm.add(key)
        return self._call(method, prompts, batch, tree)


def summarize(records: list[dict], methods: Sequence[str]) -> dict:
    """Aggregate figures over per-question records (see `run_benchmark`)."""
    sums = {key: {m: sum(r[m][key] for r in records) for m in methods} for key in ("tokens", "seconds", "steps")}
    out: dict = {"questions": len(records), "tokens_per_s": {m: sums["tokens"][m] / sums["seconds"][m]
                                                            if sums["seconds"][m] > 0 else float("nan") for m in methods},
                 **sums}
    tps = out["tokens_per_s"]
    out["speedup"] = tps["medusa"] / tps["plain"]
    out["acceleration_rate"] = out["tokens"]["medusa"] / out["steps"]["medusa"]
    out["step_overhead"] = ((out["seconds"]["medusa"] / out["steps"]["medusa"])
                            / (out["seconds"]["plain"] / out["steps"]["plain"]))
    out["mismatches"] = sum(not r["match"] for r in records)
    if "hf" in methods:
        out["speedup_vs_hf"] = tps["medusa"] / tps["hf"]
        out["plain_vs_hf"] = tps["plain"] / tps["hf"]
        out["hf_mismatches"] = sum(not r["hf_match"] for r in records)
    return out


def accept_histogram(records: list[dict], depth: int) -> list[int]:
    lengths = [a for r in records for a in r["medusa"]["accept_lengths"]]
    return np.bincount(np.asarray(lengths, int), minlength=depth + 1).tolist()


def _record(question: MTBenchQuestion, prompt: list[int], timed: dict[str, Timed], row: int = 0) -> dict:
    rec = {"question_id": question.question_id, "category": question.category, "prompt_tokens": len(prompt)}
    for m, t in timed.items():
        rec[m] = {"tokens": len(t.token_ids[row]), "seconds": t.seconds, "steps": t.steps[row]}
        if t.accept_lengths is not None:
            rec[m]["accept_lengths"] = t.accept_lengths[row]
    rec["match"] = timed["medusa"].token_ids[row] == timed["plain"].token_ids[row]
    if "hf" in timed:
        rec["hf_match"] = timed["hf"].token_ids[row] == timed["plain"].token_ids[row]
    return rec


def greedy_order_of(tree_json: dict | None) -> list[tuple[int, ...]] | None:
    """The greedy order build_tree stores (`greedy_order`: every prefix a valid tree), if the document has one."""
    if not tree_json or "greedy_order" not in tree_json:
        return None
    return [tuple(int(r) for r in p) for p in tree_json["greedy_order"]]


def sweep_order(tree_spec: str | None, heads_trees: HeadsTrees | None = None) -> list[tuple[int, ...]]:
    """Paths in an order whose every prefix is a valid tree: the greedy order stored by build_tree (in a tree
    file, or for the heads' own trees in their trees.json), the official order for presets, else the file's
    paths sorted by (length, ranks) (prefixes of that are valid)."""
    if tree_spec is None:
        resolution = resolve_tree(heads_trees, jax.default_backend(), 1)
        built = heads_trees.built(resolution.backend) if heads_trees and resolution.backend else {}
        return greedy_order_of(built) or list(MC_SIM_7B_63)
    if tree_spec in PRESETS:
        return list(MC_SIM_7B_63)
    return greedy_order_of(tree_document(tree_spec)) or sorted(load_tree(tree_spec).paths, key=lambda p: (len(p), p))


def tree_metadata(tree_spec: str | None, chosen: ChosenTree, heads_trees: HeadsTrees | None,
                  batch_size: int) -> dict:
    """build_tree's predictions when the tree is a build_tree file or the heads' own tree, else {}."""
    if tree_spec is None:
        resolution = resolve_tree(heads_trees, jax.default_backend(), batch_size)
        if heads_trees is None or resolution.backend is None:
            return {"origin": chosen.note}
        record = heads_trees.built(resolution.backend).get("batches", {}).get(str(resolution.batch), {})
        keys = ("predicted_tokens_per_step", "predicted_speedup_vs_plain", "num_nodes")
        return {"origin": chosen.note, **{k: record[k] for k in keys if k in record}}
    document = tree_document(tree_spec) or {}
    keys = ("predicted_tokens_per_step", "predicted_speedup_vs_plain", "head_top1", "num_nodes")
    return {k: document[k] for k in keys if k in document}


def tree_document(tree_spec: str) -> dict | None:
    """A tree file's JSON object (build_tree's carries its greedy order and predictions); None for a preset, a
    dynamic spec or a file of bare paths."""
    path = Path(tree_spec)
    document = json.loads(path.read_text()) if tree_spec not in PRESETS and path.is_file() else None
    return document if isinstance(document, dict) else None


def run_benchmark(loaded: LoadedModel, questions: Sequence[MTBenchQuestion], config: BenchmarkConfig,
                  progress: Callable[[str], None] = print) -> dict:
    """Runs the main interleaved comparison, the batched table and the tree sweep; returns the results dict
    (`bench_report.write_report` turns it into files)."""
    if loaded.heads is None:
        raise ValueError("the benchmark needs Medusa heads")
    heads_cfg, heads_trees = loaded.heads.config, trees_of(loaded.heads)
    # the given tree, else the heads' own, calibrated on this machine unless told to skip
    chosen = choose_tree(heads_cfg, heads_trees, config.batch_size, config.tree,
                         model=None if config.tree is not None else ShardedModel(loaded.base, loaded.heads),
                         calibration=config.calibration)
    tree = chosen.tree  # None: the heads' trees say no tree pays at this batch size; "medusa" runs plain
    progress(f"tree: {chosen.note}")
    prompts = loaded.encode_chat([q.first_turn for q in questions])
    methods = ["plain", "medusa"] + (["hf"] if config.hf else [])
    runner = Runner(loaded, config.max_new_tokens, config.hf, config.hf_threads)

    records: list[dict] = []
    b = config.batch_size
    for i in range(0, len(prompts), b):
        chunk = prompts[i: i + b]
        timed = {m: runner.run(m, chunk, b if m != "hf" else 1, tree if m == "medusa" else None) for m in methods}
        for row, (q, p) in enumerate(zip(questions[i: i + b], chunk)):
            records.append(_record(q, p, timed, row))
        last = records[-1]
        progress(f"[{len(records)}/{len(prompts)}] {last['category']}: plain {last['plain']['tokens']} tok "
                 f"{last['plain']['seconds']:.1f}s | medusa {last['medusa']['tokens']} tok "
                 f"{last['medusa']['seconds']:.1f}s {last['medusa']['steps']} steps"
                 + (f" | hf {last['hf']['seconds']:.1f}s" if config.hf else "")
                 + ("" if last["match"] else "  MISMATCH"))

    overall = summarize(records, methods)
    categories = sorted({r["category"] for r in records})
    results = {
        **{k: overall[k] for k in ("speedup", "acceleration_rate", "step_overhead", "mismatches", "tokens_per_s")},
        "overall": overall,
        "per_category": {c: summarize([r for r in records if r["category"] == c], methods) for c in categories},
        "accept_length_histogram": accept_histogram(records, tree.depth if tree else 0),
        "tree": {"spec": config.tree or "heads", "num_nodes": tree.num_tokens - 1 if tree else 0,
                 "num_tree_tokens": tree.num_tokens if tree else 1, "depth": tree.depth if tree else 0,
                 "top_k": tree.top_k if tree else 0,
                 **tree_metadata(config.tree, chosen, heads_trees, config.batch_size)},
        "heads": {"folder": portable_path(loaded.heads_folder), **dataclasses.asdict(heads_cfg)},
        "config": dataclasses.asdict(config),
        "compile_seconds": dict(runner.compile_seconds),
        "per_question": records,
    }
    if config.profile and tree is not None:
        results["step_profile"] = profile_step(loaded, tree, records, progress)
    results["batched"] = run_batched(runner, questions, prompts, config, tree, records, progress)
    results["tree_sweep"] = run_tree_sweep(runner, prompts, config, tree, progress)
    return results


def profile_step(loaded: LoadedModel, tree: TreeBuffers | DynamicTree, records: list[dict], progress) -> dict:
    """ms of each piece of one Medusa step (a static tree's; a dynamic tree is timed whole), of the whole step
    and of a plain step, batch 1, at the benchmark's median context (prompt + half the answer)."""
    context = int(np.median([r["prompt_tokens"] + r["plain"]["tokens"] // 2 for r in records]))
    size = round_up(context + 2 * tree.num_tokens + tree.depth + 1, PROMPT_BUCKET)
    args = (loaded.base, loaded.heads, tree, 1, context, size)
    pieces = {} if isinstance(tree, DynamicTree) else step_cost.piece_seconds(*args, repeats=7)
    out = {"context": context, "cache_size": size, "batch": 1,
           "pieces_ms": {k: 1e3 * v for k, v in pieces.items()},
           "medusa_step_ms": 1e3 * whole_step.medusa_step_seconds(*args, repeats=7),
           "plain_step_ms": 1e3 * whole_step.plain_step_seconds(loaded.base, 1, context, size, repeats=7)}
    progress("step profile (ms): " + ", ".join(f"{k} {v:.1f}" for k, v in out["pieces_ms"].items())
             + f"; whole Medusa step {out['medusa_step_ms']:.1f}; plain step {out['plain_step_ms']:.1f}")
    return out


def run_batched(runner: Runner, questions, prompts, config: BenchmarkConfig, tree: TreeBuffers,
                records: list[dict], progress) -> list[dict]:
    """Total tokens/s, Medusa vs plain, at each batch size (the main run gives its own batch size's row)."""
    rows = [{**_batched_row(config.batch_size, summarize(records, ["plain", "medusa"]), len(records)),
             "tree_nodes": tree.num_tokens - 1 if tree else 0}]
    for b in config.batched_sizes:
        if b == config.batch_size:
            continue
        usable = (len(prompts) // b) * b
        if usable == 0:
            progress(f"batched: skipping batch {b}: only {len(prompts)} questions")
            continue
        tree_b = choose_tree(runner.loaded.heads.config, trees_of(runner.loaded.heads), b, config.tree).tree
        # chunks of similar prompt length share a prompt bucket, so fewer shapes compile
        by_length = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))[:usable]
        recs = []
        for i in range(0, usable, b):
            members = by_length[i: i + b]
            chunk = [prompts[j] for j in members]
            timed = {m: runner.run(m, chunk, b, tree_b if m == "medusa" else None) for m in ("plain", "medusa")}
            for row in range(b):
                rec = _record(questions[members[row]], chunk[row], timed, row)
                for m in ("plain", "medusa"):  # a call's seconds are shared by its rows
                    rec[m]["seconds"] = timed[m].seconds / b
                recs.append(rec)
        rows.append({**_batched_row(b, summarize(recs, ["plain", "medusa"]), usable),
                     "tree_nodes": tree_b.num_tokens - 1 if tree_b else 0})
        progress(f"batch {b}: plain {rows[-1]['tokens_per_s']['plain']:.1f} tok/s, medusa "
                 f"{rows[-1]['tokens_per_s']['medusa']:.1f} tok/s, x{rows[-1]['speedup']:.2f}")
    return rows


def _batched_row(batch: int, s: dict, questions: int) -> dict:
    return {"batch_size": batch, "questions": questions, "tokens_per_s": s["tokens_per_s"], "speedup": s["speedup"],
            "acceleration_rate": s["acceleration_rate"], "mismatches": s["mismatches"]}


def run_tree_sweep(runner: Runner, prompts, config: BenchmarkConfig, tree: TreeBuffers, progress) -> list[dict]:
    """Medusa speedup over plain for trees of several sizes (prefixes of the tree's greedy order) on the first
    sweep_questions questions; plain is timed again next to each size, so load drift hits both alike."""
    n = min(config.sweep_questions, len(prompts))
    if n == 0 or config.batch_size != 1:
        return []
    heads_cfg = runner.loaded.heads.config
    dynamic = isinstance(tree, DynamicTree)  # a dynamic tree's sweep: the same K and D, N nodes
    order = [] if dynamic else sweep_order(config.tree, trees_of(runner.loaded.heads))
    out = []
    main = {tree.num_tokens - 1} if tree is not None else set()
    for size in sorted(set(s for s in config.sweep_sizes if dynamic or s <= len(order)) | main):
        if tree is not None and size == tree.num_tokens - 1:
            sub = tree
        else:
            try:
                sub = DynamicTree(size, tree.top_k, tree.depth) if dynamic else build_tree(
                    order[:size], name=f"prefix_{size}", num_heads=heads_cfg.num_heads,
                    max_top_k=heads_cfg.head_vocab_size)
            except TreeError as e:
                progress(f"tree sweep: skipping {size} nodes ({e})")
                continue
        medusa = [runner.run("medusa", [p], 1, sub) for p in prompts[:n]]
        plain = [runner.run("plain", [p], 1) for p in prompts[:n]]
        tokens, seconds = sum(t.tokens for t in medusa), sum(t.seconds for t in medusa)
        steps = sum(sum(t.steps) for t in medusa)
        plain_tps = sum(t.tokens for t in plain) / sum(t.seconds for t in plain)
        out.append({"num_nodes": size, "num_tree_tokens": size + 1, "acceleration_rate": tokens / steps,
                    "tokens_per_s": tokens / seconds, "plain_tokens_per_s": plain_tps,
                    "speedup": (tokens / seconds) / plain_tps, "questions": n, "is_main_tree": sub == tree,
                    "mismatches": sum(m.token_ids != p.token_ids for m, p in zip(medusa, plain))})
        progress(f"tree sweep: {size} nodes: {tokens / steps:.2f} tok/step, x{out[-1]['speedup']:.2f}")
    return out
