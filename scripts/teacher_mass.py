"""How much of the base model's next-token mass a truncated lm_head cannot represent.

A truncated head (--lm-head truncated:N) learns the base distribution renormalised over its token_map (the N
most frequent training tokens). This measures, on a self-distilled Arrow store, the average teacher mass
outside the map: the token_map is built from the training conversations' generated tokens (as train_heads.py
builds it) and the mass is averaged over the held-out conversations' reply positions (the teacher at every
position: the base lm_head on the stored hidden state).

Example:
  python scripts/teacher_mass.py --model smollm2 --data data/smollm2_distill.jsonl.arrow --sizes 2048,4096,8192
"""

from __future__ import annotations

import argparse
import json

from medusa_jax.cli_args import parse_positive_int_list


def model_dir(arg: str) -> str:
    if arg == "smollm2":
        from medusa_jax.real_model import prepare_smollm2

        return str(prepare_smollm2())
    return arg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="the HF model folder the store was generated with, or 'smollm2'")
    p.add_argument("--data", required=True, help="self-distilled Arrow store (self_distill.py --save-hidden)")
    p.add_argument("--sizes", type=parse_positive_int_list, default=(1024, 2048, 4096, 8192, 16384),
                   help="token_map sizes N to measure, comma-separated (default: 1024,2048,4096,8192,16384)")
    p.add_argument("--heldout-fraction", type=float, default=0.2,
                   help="share of conversations the mass is measured on; the map comes from the rest "
                        "(default: %(default)s)")
    p.add_argument("--max-positions", type=int, default=20000,
                   help="held-out positions measured at most (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="held-out split seed (default: %(default)s)")
    a = p.parse_args(argv)
    if not 0 < a.heldout_fraction < 1:
        p.error(f"--heldout-fraction must be in (0, 1), got {a.heldout_fraction}")

    import jax
    import jax.numpy as jnp
    import numpy as np

    from medusa_jax.hf_import import load_pretrained
    from medusa_jax.training.data import top_token_ids
    from medusa_jax.training.distill_store import is_store, load_store_examples

    if not is_store(a.data):
        p.error(f"--data {a.data} is not a self-distilled Arrow store")
    base = load_pretrained(model_dir(a.model))
    train, held, _, _ = load_store_examples(a.data, 1).split(a.heldout_fraction, a.seed)
    train_tokens = train.targets_nk[:, 0][train.targets_nk[:, 0] >= 0]
    maps = {n: top_token_ids(train_tokens, n, base.config.vocab_size) for n in a.sizes}
    probs = jax.jit(lambda h: jax.nn.softmax(base.logits(h.astype(jnp.float32)), axis=-1))
    rows = held.rows_n[np.random.default_rng(a.seed).permutation(len(held))[: a.max_positions]]
    inside = {n: 0.0 for n in a.sizes}
    for start in range(0, len(rows), 256):
        p_nv = np.asarray(probs(jnp.asarray(held.hidden.take(np.sort(rows[start:start + 256])))))
        for n, token_map in maps.items():
            inside[n] += float(p_nv[:, token_map].sum())
    result = {"positions": int(len(rows)), "train_tokens": int(len(train_tokens)),
              "mean_outside_mass": {str(n): 1.0 - inside[n] / max(len(rows), 1) for n in a.sizes}}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
