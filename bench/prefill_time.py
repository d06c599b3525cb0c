"""SmolLM2's prefill of one prompt at given padded widths (a fresh cache of the width, as the engine's admission
prefills), the widths interleaved round by round; prints each one's median seconds:

  python bench/prefill_time.py 300:384,300:512,700:768,700:1024 9
"""

import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.autoregressive import prefill
from medusa_jax.model.kv_cache import KVCache

cases = [tuple(int(x) for x in case.split(":")) for case in sys.argv[1].split(",")]  # prompt length:width
rounds = int(sys.argv[2])
graphdef, params = nnx.split(load_pretrained(prepare_smollm2()))


@jax.jit
def first_token(params, prompt_bt, lens_b):
    model = nnx.merge(graphdef, params)
    last_bd, _ = prefill(model, prompt_bt, lens_b, KVCache.zeros(model.config, *prompt_bt.shape))
    return model.logits(last_bd).argmax(-1)


rng = np.random.default_rng(0)
inputs = {}
for n, width in cases:
    prompt_bt = np.zeros((1, width), np.int32)
    prompt_bt[0, :n] = rng.integers(10, 40000, n)
    inputs[n, width] = (jnp.asarray(prompt_bt), jnp.asarray([n], jnp.int32))
    first_token(params, *inputs[n, width]).block_until_ready()  # compiled before any timing
seconds = {case: [] for case in cases}
for r in range(rounds):
    for case in cases if r % 2 == 0 else cases[::-1]:
        t0 = time.perf_counter()
        first_token(params, *inputs[case]).block_until_ready()
        seconds[case].append(time.perf_counter() - t0)
for (n, width), s in seconds.items():
    print(f"prompt {n} tokens at width {width}: median {np.median(s):.3f} s (min {min(s):.3f}, {rounds} rounds)")
