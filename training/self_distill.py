"""Self-distillation: regenerate the assistant turns of a chat dataset with the base model itself.

Heads trained on the base model's own outputs learn the distribution they will be asked to predict at
decoding time (Medusa paper, section 3.2). The user turns come from the source data; each assistant turn is
generated with `medusa_jax.inference.engine.generate` (one jitted call per batch of prompts).

Output: ShareGPT records (`{"id", "conversations": [{"from": "human"|"gpt"|"system", "value"}]}`), one per
line (JSONL), appended and fsync'ed batch by batch. A rerun skips the ids already written, so an interrupted
run resumes where it stopped; a half-written last line (killed mid-write) is cut off first.
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


def self_distill(model_dir: str | os.PathLike, data: str | None, output: str | os.PathLike,
                 config: DistillConfig = DistillConfig(), progress: bool = True,
                 log: Callable[[str], None] = print) -> dict[str, Any]:
    """Regenerates the assistant turns of `data` into `output` (JSONL, resumable). Returns run statistics."""
    from transformers import AutoTokenizer

    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.inference.engine import generate
    from medusa_jax.inference.sampling import SamplingConfig

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
    sampling = SamplingConfig(temperature=config.temperature)
    stats = {"conversations": 0, "new_tokens": 0, "seconds": 0.0, "skipped_long_prompt": len(records) - len(usable)}
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(order), initial=len(order) - len(todo), unit="conv", dynamic_ncols=True)
    start = time.perf_counter()
    for b0 in range(0, len(todo), config.batch_size):
        batch = todo[b0:b0 + config.batch_size]
        histories, users = {}, {}
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
            results = generate(model, [prompts[i] for i in rows], max_new_tokens=config.max_new_tokens,
                               sampling=sampling, seed=config.seed + b0 + turn, eos_ids=eos, pad_id=pad_id,
                               batch_size=config.batch_size)
            for i, res in zip(rows, results):
                ids = [t for t in res.token_ids if t not in eos]
                histories[i] += [{"role": "user", "content": users[i][turn]},
                                 {"role": "assistant", "content": tokenizer.decode(ids)}]
                stats["new_tokens"] += res.new_tokens
        lines = []
        for i in batch:
            if len(histories[i]) and histories[i][-1]["role"] == "assistant":
                conv = [{"from": _SHAREGPT_ROLE[m["role"]], "value": m["content"]} for m in histories[i]]
                lines.append(json.dumps({"id": records[i]["id"], "conversations": conv}, ensure_ascii=False))
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
