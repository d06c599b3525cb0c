"""A/B of XLA:CPU's dot emitters on SmolLM2 forwards of t tokens (one row, a cache of 1,100 slots): the median
seconds of 5 interleaved rounds and the ratio to t = 1. Run once per XLA_FLAGS value."""

import os
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.hf.load import load_pretrained
from medusa_jax.model.kv_cache import attention_mask
from medusa_jax.trees.policy.step_cost import make_cache

base = load_pretrained(prepare_smollm2())
graphdef, params = nnx.split(base)


@partial(jax.jit, static_argnames=("t",))
def forward(params, cache, tokens_bt, t):
    model = nnx.merge(graphdef, params)
    positions_bt = cache.lengths_b[:, None] + jnp.arange(t)[None]
    mask_bts = attention_mask(cache.lengths_b, jnp.tril(jnp.ones((t, t), bool)), cache.cache_size)
    hidden_btd, _ = model(tokens_bt, positions_bt, mask_bts, cache)
    return model.logits(hidden_btd).argmax(-1)


cache = make_cache(base, 1, 1100, 0)
widths = (1, 96, 384, 1024)
tokens = {t: jnp.zeros((1, t), jnp.int32) for t in widths}
for t in widths:
    forward(params, cache, tokens[t], t).block_until_ready()
seconds = {t: [] for t in widths}
for _ in range(5):
    for t in widths:
        start = time.perf_counter()
        forward(params, cache, tokens[t], t).block_until_ready()
        seconds[t].append(time.perf_counter() - start)
one = np.median(seconds[1])
print(os.environ.get("XLA_FLAGS", "default"),
      " ".join(f"t{t}={np.median(s) * 1e3:.1f}ms({np.median(s) / one:.2f})" for t, s in seconds.items()))
