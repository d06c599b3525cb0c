"""Which tree candidates to accept: greedy, exact (lossless sampling) and typical acceptance, as pure jnp
functions. greedy emits what plain greedy decoding emits; exact (`exact_acceptance`) samples exactly what plain
sampling at the same temperature / top-k / top-p samples; typical (the official Medusa's sampling mode) changes
the distribution for longer accepts.

Path-level arrays: b rows, c candidate paths (tree leaves), e = tree depth; index e of a [B, C, E] array is
the candidate at depth e + 1 of path c (so its parent is the depth-e node). Padding past a leaf is masked by
valid_ce.
`accept_tree` works on the T verified tree nodes: it turns the base logits of every node into these
path-level arrays (per node first, so the [B, T, V] logits are never copied per path), picks the accepted
path and the next token after it (the bonus token: the next step's root). The tree is a static TreeBuffers (its
tables are compile-time constants, shared by all rows) or a dynamic tree's per-row RowTree
(medusa_jax/trees/dynamic_tree.py): the same rules, with the tables gathered row by row.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import RowTree
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.exact_acceptance import exact_accept
from medusa_jax.inference.sampling import SamplingConfig, greedy_tokens, sample_tokens

ACCEPTANCE_KINDS = ("greedy", "exact", "typical")


@dataclasses.dataclass(frozen=True)
class AcceptanceConfig:
    """How a tree decoder accepts candidates; the distribution it samples from is the `SamplingConfig` beside it
    in the `DecodeConfig` (temperature, top-p and top-k live there only).
    greedy: accept a candidate iff it is the base model's argmax (output identical to plain greedy).
    exact: lossless sampling (`exact_acceptance`): the output has the law of plain sampling with the SamplingConfig.
    typical: accept x if p(x) > min(posterior_threshold, posterior_alpha * exp(-H(p))) with p the base
    distribution at the temperature; the bonus token is sampled from p restricted to the same typical set.
    None: greedy at temperature 0, exact otherwise (typical is opt-in)."""

    kind: str | None = None
    posterior_threshold: float = 0.09  # typical only: epsilon, the hard threshold
    posterior_alpha: float = 0.3  # typical only: delta, scales exp(-entropy)

    def __post_init__(self):
        if self.kind is not None and self.kind not in ACCEPTANCE_KINDS:
            raise ValueError(f"acceptance kind must be one of {ACCEPTANCE_KINDS}, got {self.kind!r}")
        if not 0 <= self.posterior_threshold <= 1 or self.posterior_alpha < 0:
            raise ValueError(f"need 0 <= posterior_threshold <= 1 and posterior_alpha >= 0, got "
                             f"{self.posterior_threshold}, {self.posterior_alpha}")


@dataclasses.dataclass(frozen=True)
class DecodeConfig:
    """THE decode settings of a batch: the sampling settings once (plain decoding uses them as they are) and how
    a tree decoder accepts candidates. Raises ValueError for an acceptance that cannot honour the sampling."""

    sampling: SamplingConfig = SamplingConfig()
    acceptance: AcceptanceConfig = AcceptanceConfig()

    def __post_init__(self):
        chosen = self.acceptance.kind
        if chosen == "greedy" and not self.sampling.greedy:
            raise ValueError("greedy acceptance decodes greedily: use temperature 0, or exact/typical to sample")
        if chosen in ("exact", "typical") and self.sampling.greedy:
            raise ValueError(f"{chosen} acceptance samples: give a temperature > 0 (e.g. 0.7), or use greedy")
        if self.kind == "typical" and (self.sampling.top_p != 1.0 or self.sampling.top_k != 0):
            raise ValueError("top-p and top-k do not apply to typical acceptance (it has its own thresholds); "
                             "use exact acceptance")

    @property
    def kind(self) -> str:
        """The acceptance kind, resolved (AcceptanceConfig's None: greedy at temperature 0, exact otherwise)."""
        return self.acceptance.kind or ("greedy" if self.sampling.greedy else "exact")

    @property
    def temperature(self) -> float:
        return self.sampling.temperature


GREEDY = DecodeConfig()


def _longest(accept_bce: jax.Array, valid_ce: jax.Array) -> jax.Array:
    """[B, C] number of leading accepted candidates of each path (valid_ce: [C, E], or [B, C, E] per row)."""
    ok_bce = (accept_bce & (valid_ce if valid_ce.ndim == 3 else valid_ce[None])).astype(jnp.int32)
    return jnp.sum(jnp.cumprod(ok_bce, axis=-1), axis=-1)


def greedy_accept(candidates_bce: jax.Array, predictions_bce: jax.Array,
                  valid_ce: jax.Array) -> tuple[jax.Array, jax.Array]:
    """candidates_bce: tokens at depth e+1; predictions_bce: the base argmax at each one's parent.
    Returns (accept length [B] in 0..E, index of the chosen path [B]): the first longest path."""
    length_bc = _longest(candidates_bce == predictions_bce, valid_ce)
    best_b = jnp.argmax(length_bc, axis=-1).astype(jnp.int32)
    return jnp.max(length_bc, axis=-1).astype(jnp.int32), best_b


def typical_accept(candidate_prob_bce: jax.Array, threshold_bce: jax.Array,
                   valid_ce: jax.Array) -> tuple[jax.Array, jax.Array]:
    """candidate_prob_bce: p_parent(candidate) at the temperature; threshold_bce: the parent's typical
    threshold. Accepts candidates with p > threshold; among the longest paths picks the one with the highest
    log-likelihood of its accepted candidates. Returns (accept length [B], chosen path [B])."""
    length_bc = _longest(candidate_prob_bce > threshold_bce, valid_ce)
    longest_b = jnp.max(length_bc, axis=-1)
    depth_e = jnp.arange(candidate_prob_bce.shape[-1])
    counted_bce = depth_e[None, None, :] < length_bc[..., None]
    loglik_bc = jnp.sum(jnp.where(counted_bce, jnp.log(candidate_prob_bce + 1e-30), 0.0), axis=-1)
    loglik_bc = jnp.where(length_bc == longest_b[:, None], loglik_bc, -jnp.inf)
    return longest_b.astype(jnp.int32), jnp.argmax(loglik_bc, axis=-1).astype(jnp.int32)


def typical_bound(probs_xv: jax.Array, epsilon, delta) -> jax.Array:
    """[..., V] probabilities -> [...] min(epsilon, delta * exp(-entropy)): the typical threshold, epsilon and delta
    numbers (AcceptanceConfig's posterior_threshold, posterior_alpha) or arrays that broadcast against [...] (each
    row's own: inference/row_acceptance.py)."""
    entropy_x = -jnp.sum(probs_xv * jnp.log(probs_xv + 1e-30), axis=-1)
    return jnp.minimum(epsilon, delta * jnp.exp(-entropy_x))


def typical_set_logits(scaled_bv: jax.Array, threshold_b: jax.Array) -> jax.Array:
    """Logits (already divided by the temperature) cut to the typical set: tokens whose probability reaches the
    row's threshold, and the argmax always (so the set is never empty)."""
    probs_bv = jax.nn.softmax(scaled_bv, axis=-1)
    keep_bv = (probs_bv >= threshold_b[:, None]) | (scaled_bv == jnp.max(scaled_bv, axis=-1, keepdims=True))
    return jnp.where(keep_bv, scaled_bv, -jnp.inf)


def sample_typical(logits_bv: jax.Array, key: jax.Array, config: DecodeConfig) -> jax.Array:
    """One token per row from softmax(logits / temperature) restricted to the typical set (the argmax is
    always kept, so the set is never empty). Greedy: the argmax."""
    if config.kind == "greedy":
        return greedy_tokens(logits_bv)
    scaled_bv = logits_bv.astype(jnp.float32) / config.temperature
    threshold_b = typical_bound(jax.nn.softmax(scaled_bv, axis=-1), config.acceptance.posterior_threshold,
                                config.acceptance.posterior_alpha)
    return jax.random.categorical(key, typical_set_logits(scaled_bv, threshold_b), axis=-1).astype(jnp.int32)


def sample_next(logits_bv: jax.Array, key: jax.Array, config: DecodeConfig) -> jax.Array:
    """The token after a node outside the tree walk (the first token after the prompt): the plain sampler's
    for exact, the argmax for greedy, the typical set's for typical."""
    if config.kind == "exact":
        return sample_tokens(logits_bv, key, config.sampling)
    return sample_typical(logits_bv, key, config)


def _at_nodes(x_bt: jax.Array, nodes) -> jax.Array:
    """x_bt[b, nodes[..]]: nodes a static [C, E] table (the same for every row) or per row [B, C, E]."""
    if isinstance(nodes, np.ndarray):
        return x_bt[:, jnp.asarray(nodes)]
    b = nodes.shape[0]
    return jnp.take_along_axis(x_bt, nodes.reshape(b, -1), axis=1).reshape(nodes.shape)


def accept_tree(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, key: jax.Array,
                config: DecodeConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens_bt / logits_btv: the T tree tokens and the base logits at each. Returns (accept length [B],
    accepted nodes [B, E + 1] root first (entries past the accept length are padding), bonus token [B])."""
    if config.kind == "exact":
        return exact_accept(tree, tokens_bt, logits_btv, key, config.sampling)
    if config.kind == "greedy":
        predictions_bt = greedy_tokens(logits_btv)
        length_b, nodes_be = tree_walk(tree, lambda child, parent, valid_ce: greedy_accept(
            child(tokens_bt), parent(predictions_bt), valid_ce))
    else:
        probs_btv = jax.nn.softmax(logits_btv.astype(jnp.float32) / config.temperature, axis=-1)
        typical = config.acceptance
        threshold_bt = typical_bound(probs_btv, typical.posterior_threshold, typical.posterior_alpha)
        length_b, nodes_be = typical_walk(tree, tokens_bt, probs_btv, threshold_bt)
    return length_b, nodes_be, sample_typical(path_end(logits_btv, nodes_be, length_b), key, config)


def tree_walk(tree: TreeBuffers | RowTree, accept) -> tuple[jax.Array, jax.Array]:
    """(accept length [B], accepted nodes [B, E + 1]) of the path `accept(at_children, at_parents, valid [C, E] or
    [B, C, E])` picks, given as (accept length [B], chosen path [B]); at_children(x_bt) / at_parents(x_bt) gather
    a per-node [B, T] array at each path's candidates / at their parents ([B, C, E])."""
    per_row = isinstance(tree, RowTree)
    retrieve = tree.retrieve_bce if per_row else tree.retrieve_ce
    parent_nodes_ce, child_nodes_ce = retrieve[..., :-1], retrieve[..., 1:]
    valid_ce = tree.retrieve_valid_bce[..., 1:] if per_row else jnp.asarray(tree.retrieve_valid_ce[:, 1:])
    length_b, path_b = accept(lambda x_bt: _at_nodes(x_bt, child_nodes_ce),
                              lambda x_bt: _at_nodes(x_bt, parent_nodes_ce), valid_ce)
    if per_row:
        return length_b, tree.retrieve_bce[jnp.arange(length_b.shape[0]), path_b]
    return length_b, jnp.asarray(tree.retrieve_ce)[path_b]


def typical_walk(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, probs_btv: jax.Array,
                 threshold_bt: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Typical acceptance's path: (accept length [B], accepted nodes [B, E + 1]) from every node's distribution
    at the temperature and typical threshold."""
    parent_bt = tree.parent_bt if isinstance(tree, RowTree) else jnp.asarray(tree.parent_t)[None, :]
    # p_parent(token) of every node: the probability its parent's distribution gives it
    node_prob_bt = probs_btv[jnp.arange(tokens_bt.shape[0])[:, None], parent_bt, tokens_bt]
    return tree_walk(tree, lambda child, parent, valid_ce: typical_accept(child(node_prob_bt), parent(threshold_bt),
                                                                           valid_ce))


def path_end(x_btv: jax.Array, nodes_be: jax.Array, length_b: jax.Array) -> jax.Array:
    """x_btv at each row's last accepted node: [B, V] (the bonus token's logits)."""
    last_node_b = jnp.take_along_axis(nodes_be, length_b[:, None], axis=1)[:, 0]
    return jnp.take_along_axis(x_btv, last_node_b[:, None, None], axis=1)[:, 0]
