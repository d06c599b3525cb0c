"""The records the offline replay of the mixed drafts' size rules reads (`bench.size_choice_replay`): per prompt, the
answer and, at every output position, what the drafters proposed.

Record (`record`, a real greedy decode with a debug callback in the drafted step): every step drafts and verifies
the root alone (so there is one step, and one recorded proposal, at every output position), and the callback
keeps, per position, the merged proposal of the largest size (tokens, parents, scores), the predicted accepted
tokens per size (`size_choice.predicted_accepts`) and those of prompt lookup's chains alone (what `lookup_pays`
reads). The answer is plain greedy's (the decode is lossless), so the tokens a size would accept at a position are
known exactly (`true_accepts`): the longest path among its n best nodes that the answer continues. (Token
Recycling's table then sees only the roots' logits, not the tree nodes': its drafts are somewhat weaker than in a
real run.)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Sequence

import numpy as np

from medusa_jax.bench.bench_inputs import prompt_texts


@dataclasses.dataclass
class Position:
    accepts_k: np.ndarray  # predicted accepted tokens per size (all drafters, merged)
    lookup_k: np.ndarray  # predicted accepted tokens per size of prompt lookup's chains alone (-inf scores: 0)
    true_k: np.ndarray  # tokens each size would accept here (from the known answer)


def true_accepts(tokens_t, parents_t, scores_t, answer: Sequence[int], pos: int, sizes: Sequence[int]) -> np.ndarray:
    """Accepted tokens of the n best nodes (n in sizes) at output position pos (the root is answer[pos - 1])."""
    order = sorted(range(1, len(tokens_t)), key=lambda i: (-scores_t[i], i))
    out = []
    for n in sizes:
        kept = {i for i in order[:n] if scores_t[i] > -np.inf}
        depth_of = {0: 0}
        for i in range(1, len(tokens_t)):  # parents first
            p = int(parents_t[i])
            if i in kept and p in depth_of:
                d = depth_of[p] + 1
                if pos + d - 1 < len(answer) and answer[pos + d - 1] == tokens_t[i]:
                    depth_of[i] = d
        out.append(max(depth_of.values()))
    return np.asarray(out, float)


def positions(record: dict, sizes: Sequence[int]) -> list[Position]:
    """The recorded steps' positions; the first step's root is the answer's first token (the decode loop's own
    position counter may start past the prompt)."""
    answer, first = record["answer"], record["steps"][0]["pos"]
    out = []
    for step in record["steps"]:
        pos = step["pos"] - first + 1
        assert step["tokens"][0] == answer[pos - 1], "a recorded root is not the answer's token there"
        out.append(Position(np.asarray(step["accepts_k"]), np.asarray(step["lookup_k"]),
                            true_accepts(step["tokens"], step["parents"], step["scores"], answer, pos, sizes)))
    return out


def load(path) -> list[dict]:
    return [json.loads(line) for line in open(path)]




def record(out_path, questions: int = 8, budget: int = 4, max_new_tokens: int = 128, skip: int = 0,
           prompt_set: str = "mtbench") -> None:
    """Decodes the first `questions` prompts of `prompt_set` (mtbench: MT-Bench first turns; grounded:
    `bench.grounded_prompts`; humaneval: `bench.humaneval`) with the default+recycle+lookup mix and writes one JSON
    line per prompt: the answer and every step's record (module docstring: every step drafts and verifies the root
    alone)."""
    import jax

    from medusa_jax.inference import medusa, size_choice
    from medusa_jax.inference.api import BatchSettings, generate_batch
    from medusa_jax.inference.loaded_model import load_model
    from medusa_jax.inference.mixed_decoding import build_mix
    from medusa_jax.inference.sharded import ShardedModel
    from medusa_jax.model.sharding import MeshConfig

    loaded = load_model("default", "default")
    mix, sizes = build_mix(loaded.base, ("recycle", "lookup"), loaded.heads, budget,
                           costs=lambda sizes_: (1.0,) * len(sizes_))  # unused: every step verifies the root
    model = ShardedModel(loaded.base, mix, MeshConfig())
    steps: list[dict] = []

    def keep(pos, accepts_k, lookup_k, tokens, parents, scores, choice):
        steps.append({"pos": int(pos), "accepts_k": np.asarray(accepts_k).tolist(),
                      "lookup_k": np.asarray(lookup_k).tolist(), "tokens": np.asarray(tokens).tolist(),
                      "parents": np.asarray(parents).tolist(), "scores": np.asarray(scores).tolist(),
                      "choice": int(choice)})

    original = medusa.sized_verify

    def recording(model_, state, proposal, draft, sizes_, acceptance, eos_ids, lookup=()):
        active_b = state.active_b
        accepts_k = size_choice.predicted_accepts(proposal, sizes_, active_b)
        given = model_.heads.lookup_proposals(state.draft, state.root_b)
        lookup_k = sum(size_choice.predicted_accepts(p, sizes_, active_b) for p in given.values())
        choice = size_choice.choose(accepts_k, sizes_, jax.numpy.sum(active_b).astype(jax.numpy.float32))
        jax.debug.callback(keep, state.num_out_b[0], accepts_k, lookup_k, proposal.tokens_bt[0],
                           proposal.parent_bt[0], proposal.score_bt[0], choice)
        return original(model_, state, proposal, draft, sizes_, acceptance, eos_ids, lookup)

    medusa.sized_verify = recording  # patched for this process (jit traces read them): every step verifies the root
    size_choice.SizeChoiceState.choose = lambda *args: jax.numpy.zeros((), jax.numpy.int32)
    size_choice.SizeChoiceState.drafted = lambda self, *args: self  # and drafts again
    texts = prompt_texts(prompt_set, skip + questions)[skip:]
    prompts = loaded.encode_chat(texts)
    settings = BatchSettings(batch_size=1, max_new_tokens=max_new_tokens, tree=sizes, eos_ids=tuple(loaded.eos_ids),
                             pad_id=loaded.pad_id, engine="batches", bucket=512)
    with open(out_path, "w") as f:
        for i, prompt in enumerate(prompts):
            steps.clear()
            result = generate_batch(model, [prompt], settings, progress=False).results[0]
            f.write(json.dumps({"prompt": i + skip, "answer": list(map(int, result.token_ids)),
                                "steps_taken": int(result.steps), "sizes": list(sizes.sizes),
                                "steps": sorted(steps, key=lambda s: s["pos"])}) + "\n")
            f.flush()
            print(f"prompt {i + skip}: {len(result.token_ids)} tokens, {len(steps)} steps recorded", flush=True)
