"""Self-distillation: regenerate the assistant turns of a chat dataset with the base model itself, through the
generation engine, resumable, optionally with a REPLIES hidden-state store; docs/modules.md."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from medusa_jax.settings import SEED, at_least, check_settings, setting
from medusa_jax.text import chat_prompt_ids, load_tokenizer, pad_token_id
from medusa_jax.model import sharding as shd
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.backbone import CausalLM
from medusa_jax.inference.engine import PROMPT_BUCKET, round_up
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import Request, RequestParams
from medusa_jax.inference.sampling import SamplingConfig
from medusa_jax.training import hidden_store, output_folder
from medusa_jax.training.teacher_forced import FeatureStoreConfig, chunk_hidden
from medusa_jax.training.sharegpt import DataError, read_conversations

_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}
HIDDEN_CALL_TOKENS = 4096  # tokens per forward call of the hidden-state pass (rows of config.cache_size tokens)


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = setting(512, at_least(1))  # per assistant turn
    batch_size: int = setting(64, at_least(1))  # decode rows of the engine
    chunk_steps: int = setting(32, at_least(1))  # decode steps per jitted call; finished rows refilled between calls
    max_prompt_tokens: int = setting(256, at_least(1))  # conversations whose first prompt is longer are skipped
    turns: int = setting(1, at_least(1))  # assistant turns regenerated per conversation
    temperature: float = setting(0.0, at_least(0.0))  # 0 = greedy, the distribution greedy Medusa decoding verifies
    seed: int = setting(0, SEED)  # conversation order and sampling
    limit: int | None = setting(None, at_least(1))  # stop after this many conversations (None: all)
    save_hidden: bool = False  # also keep the hidden state behind every generated token
    num_shards: int = setting(1, at_least(1))  # processes splitting the conversations
    shard_index: int = setting(0, at_least(0))  # this process's slice
    mesh: str = ""  # local device mesh for the decode slots, e.g. "data=8" ('' = one device)

    def __post_init__(self):
        check_settings(self)
        if not self.shard_index < self.num_shards:
            raise ValueError(f"--shard-index {self.shard_index}: must be in [0, --num-shards {self.num_shards})")

    @property
    def shard_limit(self) -> int | None:
        """This shard's part of `limit`."""
        if self.limit is None:
            return None
        return self.limit // self.num_shards + (self.shard_index < self.limit % self.num_shards)

    @property
    def cache_size(self) -> int:
        """Slots per row: the longest admissible prompt of the last turn plus its reply."""
        return round_up(self.turns * (self.max_prompt_tokens + self.max_new_tokens), PROMPT_BUCKET)


def read_done(output: Path) -> tuple[set[str], int, int]:
    """(ids of the complete records in `output`, their bytes, the file's bytes), reading only. Raises DataError
    for a file that is not a self-distilled JSONL (a line that is no record with an id, or no complete line and
    a start that is no record either): resuming would append to it, or cut it."""
    data = output.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    if not keep.strip() and data.strip() and not data.lstrip().startswith(b"{"):
        raise DataError(f"{output}: not a self-distilled JSONL file (it holds no record); choose another --output "
                        f"or remove the file")
    ids = set()
    for n, line in enumerate(keep.splitlines()):
        if line.strip():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (ValueError, KeyError, TypeError) as e:  # ValueError: bad JSON or bad UTF-8
                raise DataError(f"{output}: line {n + 1} is not a distilled record ({type(e).__name__}: {e}); "
                                f"choose another --output or remove the file") from None
    return ids, len(keep), len(data)


def done_ids(output: Path) -> set[str]:
    """Ids already in `output`; a broken last line (interrupted write) is removed from the file."""
    output = Path(output)
    if not output.exists():
        return set()
    ids, kept, size = read_done(output)
    if kept != size:
        with open(output, "r+b") as f:
            f.truncate(kept)
    return ids


def shard_output(output: str | os.PathLike, shard_index: int, num_shards: int) -> Path:
    """Shard i of n writes data/x.shard-i-of-n.jsonl for --output data/x.jsonl (n = 1: the output itself)."""
    output = Path(output)
    if num_shards == 1:
        return output
    return output.with_name(f"{output.stem}.shard-{shard_index}-of-{num_shards}{output.suffix}")


@dataclasses.dataclass
class _Conversation:
    """One conversation being regenerated: the messages so far and, with save_hidden, its replies."""
    record_id: str
    users: list[str]  # its user turns to answer (at most config.turns)
    messages: list[dict[str, str]]  # the system message, then the turns regenerated so far
    replies: list[tuple[int, list[int], list[int]]] = dataclasses.field(default_factory=list)  # (turn, prompt, reply)

    @property
    def turn(self) -> int:
        """The turn being answered: assistant messages so far."""
        return sum(m["role"] == "assistant" for m in self.messages)

    def next_messages(self) -> list[dict[str, str]]:
        return self.messages + [{"role": "user", "content": self.users[self.turn]}]


def self_distill(model_dir: str | os.PathLike, data: str | None, output: str | os.PathLike,
                 config: DistillConfig = DistillConfig(), progress: bool = True,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Regenerates the assistant turns of `data` into `output` (JSONL, resumable). Returns run statistics.
    One run per output at a time (`output_folder.FileLock`); a run that fails before writing leaves no new
    folder behind."""
    output = Path(output)
    with output_folder.made_folders(output), output_folder.FileLock(output):
        return _self_distill(model_dir, data, output, config, progress, log)


def _self_distill(model_dir, data, output: Path, config: DistillConfig, progress: bool, log) -> dict[str, Any]:
    records, report = read_conversations(data)
    log(report.summary())
    tokenizer = load_tokenizer(model_dir)
    model = load_pretrained(model_dir)
    eos = tuple(model.config.eos_token_ids)
    pad_id = pad_token_id(tokenizer, eos)

    def users(i):
        return [m["content"] for m in records[i]["messages"] if m["role"] == "user"][: config.turns]

    order = np.random.default_rng(config.seed).permutation(len(records)).tolist()
    order = [i for i in order if users(i)[0].strip()][config.shard_index::config.num_shards]
    finished = done_ids(output)
    store = _open_store(output, finished, model.config.hidden_size, log) if config.save_hidden else None
    todo = collections.deque(i for i in order if records[i]["id"] not in finished)
    total = len(order) if config.shard_limit is None else min(config.shard_limit, len(order))
    remaining = max(0, total - len(finished & {records[i]["id"] for i in order}))
    log(f"{len(order)} conversations with a non-empty first prompt; {len(order) - len(todo)} already in {output}; "
        f"generating up to {remaining} more")
    mesh = shd.MeshConfig.parse(config.mesh).make_mesh(jax.local_devices()) if config.mesh else None
    if mesh is not None:
        model = _model_on_mesh(model, mesh)
    rows = round_up(config.batch_size, _mesh_rows(config.mesh))  # on a mesh: a multiple of its data x fsdp rows
    engine = GenerationEngine(model, EngineConfig(rows=rows, context=config.cache_size, chunk_steps=config.chunk_steps,
                                                  max_queue=rows), eos_ids=eos, pad_id=pad_id, mesh=mesh)
    sampling = SamplingConfig(temperature=config.temperature)
    reply_limit = min(config.cache_size, model.config.max_position_embeddings)  # a later turn's prompt + reply
    inflight: dict[Request, tuple[_Conversation, list[int]]] = {}  # submitted, queued or decoding
    ready: collections.deque[tuple[_Conversation, list[int]]] = collections.deque()  # later turns, submitted first
    out_lines, out_replies = [], []
    stats = {"conversations": 0, "new_tokens": 0, "seconds": 0.0, "skipped_long_prompt": 0, "hidden_seconds": 0.0}
    bar = None
    if progress:
        bar = tqdm(total=total, initial=total - remaining, unit="conv", dynamic_ncols=True, smoothing=0.05)
    start, started = time.perf_counter(), 0

    def first_turn() -> tuple[_Conversation, list[int]] | None:
        nonlocal started
        while todo and started < remaining:
            i = todo.popleft()
            conv = _Conversation(records[i]["id"], users(i), [m for m in records[i]["messages"][:1]
                                                               if m["role"] == "system"])
            prompt = chat_prompt_ids(tokenizer, conv.next_messages())
            if len(prompt) <= config.max_prompt_tokens:
                started += 1
                return conv, prompt
            stats["skipped_long_prompt"] += 1
        return None

    def flush():
        if store is not None and out_replies:
            tick = time.perf_counter()
            store.append(_replies_with_hidden(model, out_replies, config, mesh))
            stats["hidden_seconds"] += time.perf_counter() - tick
        with open(output, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in out_lines))
            f.flush()
            os.fsync(f.fileno())
        out_lines.clear()
        out_replies.clear()

    def finish(conv: _Conversation, prompt: list[int], tokens: list[int]):
        text = tokenizer.decode([t for t in tokens if t not in eos])
        turn = conv.turn
        conv.messages = conv.next_messages() + [{"role": "assistant", "content": text}]
        stats["new_tokens"] += len(tokens)
        if config.save_hidden:
            conv.replies.append((turn, prompt, tokens))
        if turn + 1 < len(conv.users):
            prompt = chat_prompt_ids(tokenizer, conv.next_messages())
            if len(prompt) + config.max_new_tokens <= reply_limit:
                ready.append((conv, prompt))
                return
        conv_out = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in conv.messages]
        out_lines.append(json.dumps({"id": conv.record_id, "conversations": conv_out}, ensure_ascii=False))
        out_replies.extend((conv.record_id, *reply) for reply in conv.replies)
        stats["conversations"] += 1
        if bar is not None:
            bar.update(1)
        if len(out_lines) >= config.batch_size:
            flush()

    while True:
        while len(inflight) < rows:  # the engine's queue never holds more than its free rows
            item = ready.popleft() if ready else first_turn()
            if item is None:
                break
            conv, prompt = item
            params = RequestParams(max_tokens=config.max_new_tokens, sampling=sampling,
                                   seed=_request_seed(config.seed, conv.record_id, conv.turn))
            inflight[engine.submit(prompt, params)] = item
        if not inflight:
            break
        engine.run_once()
        for request in [r for r in inflight if r.finish_reason is not None]:
            finish(*inflight.pop(request), request.tokens)
        stats["seconds"] = time.perf_counter() - start
        if bar is not None:
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.0f}")
    if out_lines:
        flush()
    if bar is not None:
        bar.close()
    stats["seconds"] = time.perf_counter() - start
    return stats


def _request_seed(seed: int, record_id: str, turn: int) -> int:
    """A reply's sampling seed: its conversation's and turn's own, whatever shard, mesh or resume ran it."""
    return zlib.crc32(f"{seed}/{record_id}/{turn}".encode())


def _replies_with_hidden(model, replies: list, config: DistillConfig, mesh) -> list:
    """The store's rows (id, turn, prompt, reply, hidden [len(reply), d]) of (id, turn, prompt, reply) replies:
    the hidden state behind each reply token (the last prompt token's for the first, the previous reply
    token's after that), by packed teacher-forced forwards of prompt + reply through the base, a few rows of
    config.cache_size tokens per jitted call."""
    rows = round_up(max(1, HIDDEN_CALL_TOKENS // config.cache_size), _mesh_rows(config.mesh))
    put = jnp.asarray if mesh is None else (lambda x: jax.device_put(x, shd.batch_sharding(mesh)))
    sequences = [np.asarray(prompt + reply, np.int32) for _, _, prompt, reply in replies]
    hidden = chunk_hidden(model, sequences, FeatureStoreConfig(seq_len=config.cache_size, rows_per_call=rows), put)
    return [(rid, turn, prompt, reply, h[len(prompt) - 1: -1])
            for (rid, turn, prompt, reply), h in zip(replies, hidden)]


def _open_store(output: Path, finished: set[str], hidden_size: int, log):
    """The Arrow store of `output`, its uncommitted shards dropped (the first npz format is refused)."""
    old = hidden_store.first_format_folder(output)
    if old is not None:
        raise hidden_store.first_format_error(old)
    store = hidden_store.StoreWriter(hidden_store.store_path(output), hidden_size, hidden_store.REPLIES)
    dropped = store.drop_uncommitted(finished)
    if dropped:
        log(f"{store.folder}: dropped {len(dropped)} shard(s) whose conversations never reached {output} "
            f"(they are generated again)")
    return store


def _mesh_rows(spec: str) -> int:
    mesh = shd.MeshConfig.parse(spec)
    return mesh.data * mesh.fsdp


def _model_on_mesh(model: CausalLM, mesh) -> CausalLM:
    """The model with its weights laid out by PARAM_RULES over a mesh of this process's devices."""
    shd.validate_model_mesh(model.config, mesh)
    graphdef, params = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(params, shd.param_shardings(params, mesh)))
