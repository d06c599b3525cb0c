"""A/B of XLA:CPU's dot emitters on SmolLM2's mixed step (default+recycle+lookup@BUDGET, batch 1, context 256):
the cost of each forced size over a plain step, `R` interleaved rounds, the median. Run once per XLA_FLAGS value
(the flag is read when JAX starts), e.g. `XLA_FLAGS=--xla_cpu_experimental_ynn_fusion_type= python ...`.
Measured before `backbone.TREE_STEP_COMPILER_OPTIONS` existed: with it, the step-cost jit compiles without
YNNPACK whatever the flag says."""

import os

from medusa_jax.assets import resolve_heads_dir
from medusa_jax.demo_model import prepare_smollm2
from medusa_jax.heads.load import load_heads
from medusa_jax.hf.load import load_pretrained
from medusa_jax.inference.draft_size import forced_sizes
from medusa_jax.inference.mixed_decoding import build_mix
from medusa_jax.trees.policy import step_cost

budget, context = int(os.environ.get("BUDGET", 16)), 256
base = load_pretrained(prepare_smollm2())
heads = load_heads(resolve_heads_dir("default"), base_config=base.config, base=base)
mix, sizes = build_mix(base, ("recycle", "lookup"), heads, budget, costs=lambda s: tuple(1.0 for _ in s))
cache_size = context + max(sizes.sizes) + 2 + sizes.depth
calls = [step_cost.plain_step_call(base, 1, context, cache_size)]
calls += [step_cost.medusa_step_call(base, mix, f, 1, context, cache_size)
          for f in forced_sizes(sizes.sizes, sizes.depth)]
secs = step_cost.time_interleaved(calls, int(os.environ.get("R", 15)))
print(os.environ.get("XLA_FLAGS", "default"), budget, f"plain {secs[0] * 1e3:.1f}ms",
      " ".join(f"n{n}={s / secs[0]:.2f}" for n, s in zip(sizes.sizes, secs[1:])), flush=True)
