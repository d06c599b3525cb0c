"""Self-distillation: regenerate the assistant turns of a chat dataset with the base model itself.

Heads trained on the base model's own outputs learn the distribution they will be asked to predict at
decoding time (Medusa paper, section 3.2). The user turns come from the source data; each assistant turn is
generated with `medusa_jax.inference.engine.generate` (one jitted call per batch of prompts).

Output: ShareGPT records (`{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`), one per
line (JSONL), appended and fsync'ed batch by batch. A rerun skips the ids already written, so an interrupted
run resumes where it stopped; a half-written last line (killed mid-write) is cut off first.

With `save_hidden`, generation runs `training/distill_decode.py` instead of the engine's plain decode (same
tokens) and each batch also writes `OUTPUT.hidden/batch-<first id>.npz` (written before the batch's JSONL
lines, renamed into place): the generated token ids and the backbone's hidden state behind each of them.
`hidden_store.py` turns them into Medusa-1 training examples without another pass over the backbone.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from medusa_jax.training.sharegpt import DataError, read_conversations

_SHAREGPT_ROLE = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    max_new_tokens: int = 512  # per assistant turn
    batch_size: int = 64  # rows per jitted generation call
    max_prompt_tokens: int = 256  # conversations whose first prompt is longer are skipped
    turns: int = 1  # assistant turns regenerated per conversation
    temperature: float = 0.0  # 0 = greedy, the distribution greedy Medusa decoding verifies against
    seed: int = 0  # conversation order and sampling
    limit: int | None = None  # stop after this many conversations (None: all)
    save_hidden: bool = False  # also keep the hidden state behind every generated token (hidden_store_path)

    def __post_init__(self):
        if self.max_new_tokens < 1 or self.batch_size < 1 or self.turns < 1 or self.max_prompt_tokens < 1:
            raise ValueError(f"max_new_tokens, batch_size, turns and max_prompt_tokens must be >= 1: {self}")


def done_ids(output: Path) -> set[str]:
    """Ids already in `output`; a broken last line (interrupted write) is removed from the file."""
    if not output.exists():
        return set()
    data = output.read_bytes()
    keep = data if data.endswith(b"\n") or not data else data[: data.rfind(b"\n") + 1]
    ids = set()
    for n, line in enumerate(keep.splitlines()):
        if line.strip():
            try:
                ids.add(str(json.loads(line)["id"]))
            except (json.JSONDecodeError, KeyError) as e:
                raise DataError(f"{output}: line {n + 1} is not a distilled record ({e}); "
                                f"choose another --output or remove the file") from None
    if len(keep) != len(data):
        with open(output, "r+b") as f:
            f.truncate(len(keep))
    return ids


def _user_turns(messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[str]]:
    system = [m for m in messages[:1] if m["role"] == "system"]
    return system, [m["content"] for m in messages if m["role"] == "user"]


def _ordered(records: list[dict[str, Any]], lengths: list[int], batch_size: int, seed: int) -> list[int]:
    """A seeded shuffle, then length-sorting inside windows of 16 batches: rows of a batch have similar
    prompt lengths (less padding) while the run as a whole stays a random sample."""
    order = np.random.default_rng(seed).permutation(len(records))
    window = batch_size * 16
    out = []
    for start in range(0, len(order), window):
        chunk = order[start:start + window]
        out.extend(sorted(chunk.tolist(), key=lambda i: lengths[i]))
    return out


def hidden_store_path(output: str | os.PathLike) -> Path:
    return Path(str(output) + ".hidden")


def write_hidden_batch(folder: Path, saved: list[tuple[str, int, list[int], np.ndarray]]) -> None:
    """One .npz per batch: ids/turns of its replies, their token ids (flat, with offsets), hidden [n, D] fp16."""
    folder.mkdir(parents=True, exist_ok=True)
    lengths = [len(t) for _, _, t, _ in saved]
    arrays = {"ids": np.asarray([s[0] for s in saved]), "turns": np.asarray([s[1] for s in saved], np.int32),
              "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
              "tokens": np.concatenate([np.asarray(s[2], np.int32) for s in saved]),
              "hidden": np.concatenate([s[3] for s in saved]).astype(np.float16)}
    name = "batch-" + "".join(c if c.isalnum() else "_" for c in str(saved[0][0]))[:64]
    tmp = folder / f".{name}.tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, folder / f"{name}.npz")


def _generate(model, prompts: list[list[int]], config: DistillConfig, seed: int, eos: tuple[int, ...],
              pad_id: int) -> list[tuple[list[int], np.ndarray | None]]:
    """(new token ids, hidden [n, D] or None) per prompt; EOS included when produced."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from medusa_jax.inference.engine import check_fits, generate, pad_prompts
    from medusa_jax.inference.sampling import SamplingConfig
    from medusa_jax.kv_cache import KVCache
    from medusa_jax.training.distill_decode import decode_with_hidden

    sampling = SamplingConfig(temperature=config.temperature)
    if not config.save_hidden:
        results = generate(model, prompts, max_new_tokens=config.max_new_tokens, sampling=sampling, seed=seed,
                           eos_ids=eos, pad_id=pad_id, batch_size=config.batch_size)
        return [(r.token_ids, None) for r in results]
    batch = pad_prompts(prompts, pad_id, config.batch_size)
    size = check_fits(batch, config.max_new_tokens, 0, None)
    graphdef, params = nnx.split(model)
    cache = KVCache.zeros(model.config, batch.tokens_bp.shape[0], size)
    out_bn, num_b, hidden_bnd = decode_with_hidden(
        graphdef, params, cache, jnp.asarray(batch.tokens_bp), jnp.asarray(batch.lengths_b), jax.random.key(seed),
        max_new_tokens=config.max_new_tokens, sampling=sampling, eos_ids=eos, pad_id=pad_id)
    out_bn, num_b, hidden_bnd = np.asarray(out_bn), np.asarray(num_b), np.asarray(hidden_bnd)
    return [(out_bn[i, : num_b[i]].tolist(), hidden_bnd[i, : num_b[i]]) for i in range(batch.num_real)]


def self_distill(model_dir: str | os.PathLike, data: str | None, output: str | os.PathLike,
                 config: DistillConfig = DistillConfig(), progress: bool = True,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Regenerates the assistant turns of `data` into `output` (JSONL, resumable). Returns run statistics."""
    from transformers import AutoTokenizer

    from medusa_jax.hf_import import load_pretrained

    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    records, report = read_conversations(data)
    log(report.summary())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_pretrained(model_dir)
    eos = tuple(model.config.eos_token_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)

    def prompt_ids(messages):
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])

    firsts = []
    for r in records:
        system, users = _user_turns(r["messages"])
        firsts.append(prompt_ids(system + [{"role": "user", "content": users[0]}]))
    usable = [i for i, p in enumerate(firsts)
              if len(p) <= config.max_prompt_tokens and _user_turns(records[i]["messages"])[1][0].strip()]
    order = [usable[i] for i in _ordered([records[i] for i in usable], [len(firsts[i]) for i in usable],
                                         config.batch_size, config.seed)]
    if config.limit is not None:
        order = order[: config.limit]
    finished = done_ids(output)
    todo = [i for i in order if records[i]["id"] not in finished]
    log(f"{len(usable)} conversations have a non-empty first prompt of <= {config.max_prompt_tokens} tokens; "
        f"{len(order) - len(todo)} already in {output}, {len(todo)} to generate")
    stats = {"conversations": 0, "new_tokens": 0, "seconds": 0.0, "skipped_long_prompt": len(records) - len(usable)}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(order), initial=len(order) - len(todo), unit="conv", dynamic_ncols=True)
    start = time.perf_counter()
    for b0 in range(0, len(todo), config.batch_size):
        batch = todo[b0:b0 + config.batch_size]
        histories, users, saved = {}, {}, []
        for i in batch:
            system, turns = _user_turns(records[i]["messages"])
            histories[i], users[i] = list(system), turns[: config.turns]
        for turn in range(config.turns):
            rows = [i for i in batch if turn < len(users[i])]
            prompts = {i: prompt_ids(histories[i] + [{"role": "user", "content": users[i][turn]}]) for i in rows}
            limit = config.max_prompt_tokens if turn == 0 else config.max_prompt_tokens + turn * config.max_new_tokens
            rows = [i for i in rows if len(prompts[i]) <= limit]
            if not rows:
                break
            results = _generate(model, [prompts[i] for i in rows], config, seed=config.seed + b0 + turn,
                                eos=eos, pad_id=pad_id)
            for i, (token_ids, hidden) in zip(rows, results):
                text = tokenizer.decode([t for t in token_ids if t not in eos])
                histories[i] += [{"role": "user", "content": users[i][turn]},
                                 {"role": "assistant", "content": text}]
                stats["new_tokens"] += len(token_ids)
                if hidden is not None:
                    saved.append((records[i]["id"], turn, token_ids, hidden))
        lines = []
        for i in batch:
            if len(histories[i]) and histories[i][-1]["role"] == "assistant":
                conv = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in histories[i]]
                lines.append(json.dumps({"id": records[i]["id"], "conversations": conv}, ensure_ascii=False))
        if config.save_hidden and saved:
            write_hidden_batch(hidden_store_path(output), saved)
        with open(output, "a", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        stats["conversations"] += len(lines)
        stats["seconds"] = time.perf_counter() - start
        if bar is not None:
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{stats['new_tokens'] / max(stats['seconds'], 1e-9):.0f}")
    if bar is not None:
        bar.close()
    return stats
