"""Lossless ("exact") sampling over a Medusa tree: the emitted tokens have exactly the plain sampler's law.

Target. At every tree node u the target q_u is the plain sampler's distribution of the next token given the
prompt, the tokens emitted so far and u's path: softmax(sampling.target_logits(logits at u)), i.e. the same
temperature, top-k and top-p code that `sample_tokens` runs. The drafts are point masses: node u's children
x_1, ..., x_m (in rank order) are fixed before any coin is drawn (they come from the heads' top-k at the
previous step's hidden state, or from any proposer that does not look at this step's coins).

Walk. Start at the root (the last emitted token). At node u try its children in rank order: child x_i is
accepted with probability q(x_i) under the current q; on rejection q(x_i) <- 0 and q is renormalised. After
an acceptance, descend to that child and repeat with its own target. When every child of the current node
is rejected (or it has none: a leaf), the step's last token (the bonus) is drawn from what is left of q:
q with the rejected children's tokens removed, renormalised (a leaf's full q).

Why the law is exact. Fix node u and its distinct children; write S_i = q(x_1) + ... + q(x_i), S_0 = 0.
After the rejections of x_1..x_{i-1} the current q gives x_i the mass q(x_i) / (1 - S_{i-1}), so
    P(x_i is emitted) = prod_{j<i} (1 - q(x_j) / (1 - S_{j-1})) * q(x_i) / (1 - S_{i-1})
                      = prod_{j<i} ((1 - S_j) / (1 - S_{j-1})) * q(x_i) / (1 - S_{i-1})
                      = (1 - S_{i-1}) * q(x_i) / (1 - S_{i-1}) = q(x_i)            (the product telescopes)
and for a token y that is no child, P(y) = P(all rejected) * q(y) / (1 - S_m) = (1 - S_m) q(y) / (1 - S_m)
= q(y). So the token emitted after u is distributed as q_u, whatever the tree looks like. If it is the child
x_i, the next token is decided at node x_i with coins not used before, and x_i's target is the plain
conditional given the prefix extended by x_i; if it is a bonus token the step ends and the next step builds
a new tree from the extended prefix, again before drawing its coins. So every emitted token, given all the
tokens before it, is distributed as the plain sampler's conditional, and by the chain rule the whole emitted
sequence (cut at the first EOS or at max_new_tokens, rules that look only at the emitted tokens, as plain
decoding's do) has the plain sampler's distribution. It relies on: (1) each trial's coin is fresh, (2) the
children of a node are distinct tokens, (3) the tree does not depend on the coins, (4) the verify forward's
logits at a node equal a plain forward's on the same prefix (the greedy losslessness tests check that).

Distinct siblings. In a `medusa_choices` tree all children of one node are the same head's top-k ranks at
one hidden state (paths [..., a] and [..., b] with a != b), and `jax.lax.top_k` returns distinct indices
(a truncated head's token_map is one-to-one), so siblings are distinct tokens. A custom proposer may still repeat a token among siblings: a repeat is given
probability 0 here (its token was already zeroed when the first copy was rejected), which is exactly what
the walk above does, so the law stays exact.

Vectorised. A node is tried at most once per step, so every node gets one uniform u_t up front and the
event "x_t accepted when tried" is u_t * (1 - S_before(t)) < q_parent(x_t), with S_before(t) the mass of
its earlier (distinct) siblings: a [B, T] computation from the [B, T, V] verified logits. The walk itself is
E static rounds (E = tree depth) over a [T, J] table of each node's children (J = the most children of any
node): each round moves every row to its first accepted child, or stops it. No Python runs per token.

Dynamic trees. The tree may be a dynamic tree's per-row RowTree (medusa_jax/trees/dynamic_tree.py): the same walk over
per-row tables ([B, T, J] children, [B, T, T] earlier siblings). Conditions (2) and (3) hold: a dynamic tree is
grown from the drafter's probabilities before any coin is drawn, and siblings are the top-K of one distribution.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from medusa_jax.trees.dynamic_tree import RowTree
from medusa_jax.trees.tree import TreeBuffers
from medusa_jax.inference.sampling import SamplingConfig, target_logits


def children_table(tree: TreeBuffers) -> np.ndarray:
    """[T, J] int32: the children of each node in rank order (node order = rank order among siblings, as
    paths are sorted by (length, ranks)), padded with -1; J >= 1."""
    kids = [[] for _ in range(tree.num_tokens)]
    for t in range(1, tree.num_tokens):
        kids[int(tree.parent_t[t])].append(t)
    table_tj = np.full((tree.num_tokens, max(1, max(len(k) for k in kids))), -1, np.int32)
    for u, k in enumerate(kids):
        table_tj[u, : len(k)] = k
    return table_tj


def earlier_siblings(tree: TreeBuffers) -> np.ndarray:
    """[T, T] bool: [t, s] is True when s is a sibling of t tried before it (same parent, lower rank)."""
    t_idx = np.arange(tree.num_tokens)
    same_parent_tt = tree.parent_t[:, None] == tree.parent_t[None, :]
    return same_parent_tt & (t_idx[None, :] < t_idx[:, None]) & (t_idx[None, :] > 0) & (t_idx[:, None] > 0)


def trial_outcomes(tokens_bt: jax.Array, node_prob_bt: jax.Array, uniform_bt: jax.Array,
                   tree: TreeBuffers | RowTree) -> jax.Array:
    """[B, T] bool: would node t be accepted when tried? node_prob_bt: q_parent(token_t); uniform_bt: one
    fresh U[0, 1) coin per node. A token repeating an earlier sibling's has probability 0 (see the docstring)."""
    if isinstance(tree, RowTree):
        earlier_btt = tree.earlier_btt
        repeat_bt = jnp.any(earlier_btt & (tokens_bt[:, :, None] == tokens_bt[:, None, :]), axis=-1)
        prob_bt = jnp.where(repeat_bt, 0.0, node_prob_bt)
        mass_before_bt = jnp.einsum("bs,bts->bt", prob_bt, earlier_btt.astype(prob_bt.dtype))
        return uniform_bt * jnp.maximum(1.0 - mass_before_bt, 0.0) < prob_bt
    earlier_tt = jnp.asarray(earlier_siblings(tree))
    repeat_bt = jnp.any(earlier_tt[None] & (tokens_bt[:, :, None] == tokens_bt[:, None, :]), axis=-1)
    prob_bt = jnp.where(repeat_bt, 0.0, node_prob_bt)
    mass_before_bt = jnp.einsum("bs,ts->bt", prob_bt, earlier_tt.astype(prob_bt.dtype))
    left_bt = jnp.maximum(1.0 - mass_before_bt, 0.0)  # the current q's normaliser when t is tried
    return uniform_bt * left_bt < prob_bt  # strict: a token with q = 0 is never accepted


def _children_of(tree: TreeBuffers | RowTree, node_b: jax.Array) -> jax.Array:
    """[B, J] the children of each row's node node_b[b], in rank order, -1-padded."""
    if isinstance(tree, RowTree):
        return tree.children_btj[jnp.arange(node_b.shape[0]), node_b]
    return jnp.asarray(children_table(tree))[node_b]


def exact_accept(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, logits_btv: jax.Array, key: jax.Array,
                 sampling: SamplingConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """tokens_bt / logits_btv: the T tree tokens and the base logits at each. Returns (accept length [B],
    accepted nodes [B, E + 1] root first (past the accept length: the last accepted node repeated), bonus
    token [B]) with the plain sampler's law (module docstring)."""
    coin_key, bonus_key = jax.random.split(key)
    length_b, nodes_be, residual_bv = exact_walk(tree, tokens_bt, target_logits(logits_btv, sampling),
                                                 jax.random.uniform(coin_key, tokens_bt.shape))
    return length_b, nodes_be, jax.random.categorical(bonus_key, residual_bv, axis=-1).astype(jnp.int32)


def exact_walk(tree: TreeBuffers | RowTree, tokens_bt: jax.Array, target_btv: jax.Array,
               uniform_bt: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The walk of the module docstring with the target logits at every node (target_btv: `target_logits` of
    the base logits, each row's own settings allowed) and one fresh U[0, 1) coin per node. Returns (accept
    length [B], accepted nodes [B, E + 1], the logits [B, V] the bonus token is drawn from)."""
    b = tokens_bt.shape[0]
    rows_b = jnp.arange(b)
    log_q_btv = jax.nn.log_softmax(target_btv, axis=-1)
    parent_bt = tree.parent_bt if isinstance(tree, RowTree) else jnp.asarray(tree.parent_t)[None, :]
    node_prob_bt = jnp.exp(log_q_btv[rows_b[:, None], parent_bt, tokens_bt])  # q_parent(token_t)
    accept_bt = trial_outcomes(tokens_bt, node_prob_bt, uniform_bt, tree)

    node_b = jnp.zeros((b,), jnp.int32)
    alive_b = jnp.ones((b,), bool)
    visited = [node_b]
    for _ in range(tree.depth):  # one round per depth: move to the first accepted child, or stop
        kids_bj = _children_of(tree, node_b)
        ok_bj = (kids_bj >= 0) & jnp.take_along_axis(accept_bt, jnp.maximum(kids_bj, 0), axis=1)
        move_b = alive_b & jnp.any(ok_bj, axis=1)
        first_b = jnp.argmax(ok_bj, axis=1)
        node_b = jnp.where(move_b, kids_bj[rows_b, first_b], node_b)
        alive_b = move_b
        visited.append(node_b)
    nodes_be = jnp.stack(visited, axis=1)
    length_b = jnp.sum(nodes_be[:, 1:] != nodes_be[:, :-1], axis=1).astype(jnp.int32)

    # bonus: the last accepted node's q without its (all rejected) children's tokens; a leaf keeps all of q
    kids_bj = _children_of(tree, node_b)
    kid_tokens_bj = jnp.where(kids_bj >= 0, jnp.take_along_axis(tokens_bt, jnp.maximum(kids_bj, 0), axis=1),
                              target_btv.shape[-1])  # out of range: dropped by the scatter
    last_bv = target_btv[rows_b, node_b]
    residual_bv = last_bv.at[rows_b[:, None], kid_tokens_bj].set(-jnp.inf, mode="drop")
    # rounding can leave no mass outside children that were all rejected; then fall back to the full q
    return length_b, nodes_be, jnp.where(jnp.any(residual_bv > -jnp.inf, axis=1, keepdims=True), residual_bv,
                                         last_bv)
