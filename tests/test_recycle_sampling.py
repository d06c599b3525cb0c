"""Exact sampling with Token Recycling drafts keeps the plain sampler's law (the statistical check, the model
and the prompts of tests/test_exact_sampling.py). The drafts are deterministic given the table, and the table
changes only between steps (from the verify logits), so each step's tree is fixed before its coins are drawn:
the accept/resample rule of exact acceptance applies unchanged (docs: GUIDE 3d)."""

from __future__ import annotations

import jax.numpy as jnp
import jax
import numpy as np
from flax import nnx

from medusa_jax.heads.medusa import MedusaModel
from medusa_jax.heads.recycle import RecycleConfig, RecycleDrafter

from test_exact_sampling import PROMPTS, V, WIDTH, draw_with_heads, law_check, passes, setup, target_probs  # noqa: F401


def test_exact_sampling_with_recycling_drafts_has_the_plain_samplers_law(setup):  # noqa: F811
    graphdef, params, laws, _ = setup
    base = nnx.merge(graphdef, params).base
    # a warm table: each token's 3 likeliest successors after it alone (the in-loop updates then follow each row)
    q_vv = np.asarray(target_probs(graphdef, params, jnp.arange(V, dtype=jnp.int32)[:, None],
                                   jnp.ones((V,), jnp.int32)))
    table_vr = np.argsort(-q_vv, axis=-1, kind="stable")[:, :3].astype(np.int32)
    drafter = RecycleDrafter(RecycleConfig(32, V, top_k=3, max_depth=2), table_vr)
    g, p = nnx.split(MedusaModel(base, drafter))
    prompts = PROMPTS[:2]
    prompt_bt = np.zeros((len(prompts), WIDTH), np.int32)
    for i, q in enumerate(prompts):
        prompt_bt[i, : len(q)] = q
    keys_x = jax.random.split(jax.random.key(13), 10_000)
    out_xbo, accept_xb = draw_with_heads(g, p, jnp.asarray(prompt_bt), jnp.asarray([len(q) for q in prompts]),
                                         keys_x, graphdef_config=base.config)
    check = law_check(np.asarray(out_xbo), [0, 1], laws)
    assert check["n"] >= 20_000 and passes(check), check
    share = np.bincount(np.asarray(accept_xb).ravel(), minlength=3) / accept_xb.size
    assert share[1] > 0.05 and share[2] > 0.01, share  # depth-1 and depth-2 drafts are accepted
