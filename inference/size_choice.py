"""How a mixed-draft step chooses its draft size, inside the jitted decode loop, from what this run's drafted steps
accepted: each size's running estimate of accepted tokens per row (a step that verified n nodes also shows what
every smaller size would have accepted: the best m nodes of a candidate tree hold all their ancestors, so the path
that m nodes accept is the part of the accepted path ranked among them), with the drafters' own prediction for the
step as a prior worth `PRIOR` steps and prompt lookup's chains able to raise it (a long match: a repeat). A
drafted step verifies the size with the most estimated tokens per unit of time; when even that one loses to plain
steps on the run's average, the following steps skip the drafting (a backoff of 1, 2, 4, ... steps that a drafted
probe ends; prompt lookup's chains override it). Why, and the rule at batch > 1: docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from medusa_jax.heads.draft_merge import DraftSizes, expected_accepts
from medusa_jax.trees.dynamic_tree import TreeProposal

MAX_SKIP = 8  # the longest run of steps without drafting after drafted steps that did not pay
# a size's estimate (`SizeChoiceState.estimates`): each drafted step weighs DECAY of the earlier ones, and a prior
# worth PRIOR steps (the step's corrected prediction when choosing, the break-even accepts when judging the run)
PRIOR = 3.0
DECAY = 0.97


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SizeChoiceState:
    """Carried through the decode loop (one per batch); [k]: one entry per size of the `DraftSizes`."""

    skip_left: jax.Array  # int32: steps still to run without drafting
    misses: jax.Array  # int32: drafted steps in a row after which the run's best size did not pay
    seen_k: jax.Array  # float32 [k]: drafted steps that showed the size (verified it or a larger one; decayed)
    accepted_k: jax.Array  # float32 [k]: tokens per active row the size accepted in those steps (decayed sum)
    realised: jax.Array  # float32: accepted tokens of this run's drafted steps of their chosen size (decayed sum)
    predicted: jax.Array  # float32: the tokens the drafters predicted for those steps (decayed sum)

    @staticmethod
    def start(sizes: DraftSizes) -> "SizeChoiceState":
        k = len(sizes.sizes)  # own buffers: calls donate them
        return SizeChoiceState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((k,), jnp.float32),
                               jnp.zeros((k,), jnp.float32), jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

    @property
    def correction(self) -> jax.Array:
        """The factor the drafters' predicted accepted tokens are scaled by (float32 scalar): what this run's drafted
        steps accepted over what was predicted for them (1 before any)."""
        return (self.realised + PRIOR) / (self.predicted + PRIOR)

    @property
    def drafts(self) -> jax.Array:
        """Whether this step drafts (bool scalar)."""
        return self.skip_left <= 0

    def estimates(self, sizes: DraftSizes, prior_k: jax.Array | None = None) -> jax.Array:
        """[k] estimated accepted tokens per active row of a step verifying each size: the run's decayed mean, with
        `prior_k` (default: the break-even accepts, costs - 1) weighing PRIOR steps."""
        costs_k = jnp.asarray(sizes.costs, jnp.float32)
        prior_k = costs_k - 1 if prior_k is None else prior_k
        return (self.accepted_k + PRIOR * prior_k) / (self.seen_k + PRIOR)

    def choose(self, accepts_k: jax.Array, lookup_k: jax.Array, sizes: DraftSizes, rows: jax.Array) -> jax.Array:
        """The index into sizes.sizes (int32 scalar) of a drafted step: the size with the most estimated tokens per
        unit of time, (1 + estimate) / cost per row (`best_size`). `accepts_k` / `lookup_k`:
        the drafters' / prompt lookup's chains' predicted accepted tokens of the `rows` active rows (scaled by the
        run's correction, the first is the prior; the second, lookup's measured acceptance, is a floor)."""
        rows = jnp.maximum(rows, 1.0)
        estimate_k = jnp.maximum(self.estimates(sizes, self.correction * accepts_k / rows), lookup_k / rows)
        return best_size(estimate_k, sizes)

    def skipped(self) -> "SizeChoiceState":
        """After a step that did not draft."""
        return dataclasses.replace(self, skip_left=jnp.maximum(self.skip_left - 1, 0))

    def drafted(self, sizes: DraftSizes, choice: jax.Array, accepted_k: jax.Array, rows: jax.Array,
                predicted: jax.Array) -> "SizeChoiceState":
        """After a drafted step of size index `choice` over `rows` active rows: `accepted_k` [k] the tokens each size
        up to the chosen one accepted (`accepted_per_size`; the rest are not read), `predicted` what the drafters
        predicted for the chosen size (uncorrected). When it verified nodes, the sizes it showed learn it and the
        others' weight decays (a step that verified the root alone teaches nothing and never pays); then the run's
        best size judged on its estimate alone (break-even prior; among the sizes shown at least one step's weight)
        decides the backoff: when its
        (1 + estimate) / cost loses to a plain step, the next 1, 2, 4, ... (at most MAX_SKIP) steps skip the
        drafting; otherwise every step drafts."""
        shown_k = jnp.arange(len(sizes.sizes)) <= choice
        verified = jnp.asarray(sizes.sizes, jnp.int32)[choice] > 0  # index 0 is a plain step only when sizes[0] is 0
        rows = jnp.maximum(rows, 1.0)
        seen_k = jnp.where(verified, DECAY * self.seen_k + shown_k, self.seen_k)
        sums_k = jnp.where(verified, DECAY * self.accepted_k + jnp.where(shown_k, accepted_k / rows, 0.0),
                           self.accepted_k)
        state = dataclasses.replace(self, seen_k=seen_k.astype(jnp.float32), accepted_k=sums_k.astype(jnp.float32))
        accepted = jnp.take(accepted_k, choice)
        realised = jnp.where(verified, DECAY * self.realised + accepted, self.realised)
        predicted = jnp.where(verified, DECAY * self.predicted + predicted, self.predicted)
        gain_k = (1 + state.estimates(sizes)) / jnp.asarray(sizes.costs, jnp.float32)
        judged_k = (jnp.asarray(sizes.sizes) > 0) & (seen_k >= 1)  # shown by this step or recently: not a prior
        pays = verified & (jnp.max(jnp.where(judged_k, gain_k, 0.0)) >= 1)
        misses = jnp.where(pays, 0, self.misses + 1)
        skip = jnp.where(pays, 0, jnp.minimum(jnp.left_shift(1, jnp.clip(misses - 1, 0, 8)), MAX_SKIP))
        return dataclasses.replace(state, skip_left=skip.astype(jnp.int32), misses=misses.astype(jnp.int32),
                                   realised=realised.astype(jnp.float32), predicted=predicted.astype(jnp.float32))


def best_size(accepts_k: jax.Array, sizes: DraftSizes) -> jax.Array:
    """The index (int32 scalar) with the most tokens per unit of time, (1 + accepts_k) / cost per row, among the
    sizes that verify nodes and could pay: a drafted step that verifies the root alone costs more than a skipped one
    and shows nothing, so size 0 is verified only where no other size could beat it even if every node it verifies
    were accepted (priced out, as when size 0 is timed: `draft_size.forced_sizes`; such steps never pay, so the
    backoff then skips the drafting)."""
    if sizes.sizes[0] == 0:
        drafted_k = [n > 0 and (1 + min(n, sizes.depth)) / c > 1 / sizes.costs[0]
                     for n, c in zip(sizes.sizes, sizes.costs)]
    else:
        drafted_k = [True] * len(sizes.sizes)
    if not any(drafted_k):
        return jnp.zeros((), jnp.int32)
    gain_k = (1 + accepts_k) / jnp.asarray(sizes.costs, jnp.float32)
    return jnp.argmax(jnp.where(jnp.asarray(drafted_k), gain_k, -jnp.inf)).astype(jnp.int32)


def accepted_per_size(score_bn: jax.Array, path_be: jax.Array, accept_b: jax.Array, active_b: jax.Array,
                      sizes: DraftSizes, verified: int) -> jax.Array:
    """[k] tokens the active rows would have accepted with each size up to `verified` nodes, from a step that
    verified the best `verified` nodes (`draft_merge.keep_best`, scores `score_bn` [b, verified] of nodes 1..n) and
    accepted `accept_b` nodes along `path_be` (node indices, the root first): a size of m nodes holds the path's
    nodes ranked below m, and its path ends at the first one it lacks. Sizes above `verified`: 0."""
    b, n = score_bn.shape
    i_n1, j_1n = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    # rank: nodes scored higher, and equal ones earlier (lax.top_k's order)
    above_bnn = (score_bn[:, None, :] > score_bn[:, :, None]) | ((score_bn[:, None, :] == score_bn[:, :, None])
                                                                 & (j_1n < i_n1))
    rank_bn = jnp.sum(above_bnn, axis=2)
    e = path_be.shape[1]
    node_bd = jnp.clip(path_be[:, 1:] - 1, 0, n - 1)  # depths 1..e-1
    rank_bd = jnp.take_along_axis(rank_bn, node_bd, axis=1)
    on_path_bd = jnp.arange(1, e)[None, :] <= accept_b[:, None]
    counts = []
    for m in sizes.sizes:
        if m > verified:
            counts.append(jnp.zeros((), jnp.float32))
            continue
        kept_bd = jnp.cumprod(on_path_bd & (rank_bd < m), axis=1)
        counts.append(jnp.sum(jnp.where(active_b, jnp.sum(kept_bd, axis=1), 0)).astype(jnp.float32))
    return jnp.stack(counts)


def predicted_accepts(proposal: TreeProposal, sizes: DraftSizes, active_b: jax.Array) -> jax.Array:
    """[k] predicted accepted tokens of all active rows if the best n nodes of each row are verified, n in
    sizes.sizes: the drafters' own prediction (`draft_merge.expected_accepts`)."""
    return jnp.sum(jnp.where(active_b[:, None], expected_accepts(proposal, sizes.sizes), 0.0), axis=0)


def choose(accepts_k: jax.Array, sizes: DraftSizes, rows: jax.Array) -> jax.Array:
    """The index into sizes.sizes (int32 scalar) with the most predicted tokens of the `rows` active rows per unit
    of time, from the drafters' predictions alone (a loop whose state carries no `SizeChoiceState`): a step
    verifying n nodes per row emits rows + accepts_k[n] tokens and costs sizes.costs[n] plain steps."""
    gain_k = (rows + accepts_k) / jnp.asarray(sizes.costs, jnp.float32)
    return jnp.argmax(gain_k).astype(jnp.int32)


def lookup_pays(proposals: Sequence[TreeProposal], sizes: DraftSizes, active_b: jax.Array) -> jax.Array:
    """Whether the mix's prompt-lookup chains alone (`proposals`: `MixedDrafter.lookup_proposals`, drafted once per
    step and reused by a drafted step; scored with lookup's measured acceptance, so uncorrected) predict a drafted
    step that beats the plain step it would replace (bool scalar; False with no lookup member): some drafted size
    n > 0 whose rows + predicted accepts per its cost exceed the rows of a plain step (cost 1; a step that skips
    the drafting costs what a plain step does, not `sizes.costs[0]`, which also pays the drafting)."""
    rows = jnp.sum(active_b).astype(jnp.float32)
    drafted_k = jnp.asarray(sizes.sizes) > 0
    pays = jnp.zeros((), bool)
    for proposal in proposals:
        gain_k = (rows + predicted_accepts(proposal, sizes, active_b)) / jnp.asarray(sizes.costs, jnp.float32)
        pays |= jnp.any(drafted_k & (gain_k > rows))
    return pays
