"""How a mixed-draft step chooses its draft size, inside the jitted decode loop, from what this run's drafted steps
accepted by the rows that count (`SizeChoiceState.counted_rows`). A step that verified n nodes also shows what
every smaller size would have accepted (the best m nodes of a candidate tree hold all their ancestors, so the path
that m nodes accept is the part of the accepted path ranked among them). Per size the run keeps what it accepted
against what the drafters predicted in the steps that showed it; a drafted step verifies the size with the most
estimated tokens per unit of time, its estimate the drafters' prediction for this step scaled by that size's ratio
(prior: the run-wide ratio, worth `RATIO_PRIOR` predicted tokens), prompt lookup's chains a floor (a long match: a
repeat). When even the run's best size loses to plain steps on its running mean, the following steps skip the
drafting (a backoff of 1, 2, 4, ... steps that a drafted probe ends; prompt lookup's chains override it). Why, and
the rule at batch > 1: docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from medusa_jax.heads.draft_merge import DraftSizes, expected_accepts
from medusa_jax.trees.dynamic_tree import TreeProposal

MAX_SKIP = 8  # the longest run of steps without drafting after drafted steps that did not pay
# the run's sums: each drafted step weighs DECAY of the earlier ones. A size's running mean (`estimates`, judging
# the backoff) has the break-even accepts as a prior worth PRIOR steps; a size's ratio of accepted to predicted
# tokens (`ratios`, scaling the step's prediction) has the run-wide ratio as a prior worth RATIO_PRIOR predicted
# tokens, and the run-wide ratio (`correction`) has 1 worth as many
PRIOR = 3.0
RATIO_PRIOR = 3.0
DECAY = 0.97


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SizeChoiceState:
    """Carried through the decode loop (one per batch); [k]: one entry per size of the `DraftSizes`."""

    skip_left: jax.Array  # int32: steps still to run without drafting
    misses: jax.Array  # int32: drafted steps in a row after which the run's best size did not pay
    seen_k: jax.Array  # float32 [k]: drafted steps that showed the size (verified it or a larger one; decayed)
    accepted_k: jax.Array  # float32 [k]: tokens per counted row the size accepted in those steps (decayed sum)
    predicted_k: jax.Array  # float32 [k]: tokens per counted row the drafters predicted for it there (decayed sum)
    realised: jax.Array  # float32: accepted tokens per counted row of the drafted steps' chosen sizes (decayed sum)
    predicted: jax.Array  # float32: the tokens per counted row the drafters predicted for those (decayed sum)
    # bool: the rows end together (a batch call with no prompt waiting for a row), so only the rows with the most
    # tokens left count (`counted_rows`); False: every active row counts (a server's rows, or rows refilled)
    together: jax.Array

    @staticmethod
    def start(sizes: DraftSizes, together: bool = True) -> "SizeChoiceState":
        k = len(sizes.sizes)  # own buffers: calls donate them
        return SizeChoiceState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32), jnp.zeros((k,), jnp.float32),
                               jnp.zeros((k,), jnp.float32), jnp.zeros((k,), jnp.float32), jnp.zeros((), jnp.float32),
                               jnp.zeros((), jnp.float32), jnp.asarray(together, bool))

    def counted_rows(self, active_b: jax.Array, left_b: jax.Array) -> jax.Array:
        """[b] bool: the rows whose tokens the choice counts (their predictions, what they accepted). Rows that end
        together (`together`) end when the last one does, so a step pays only for the rows with the most tokens left
        (`left_b`: each row's budget left; ties all count): a step that the other rows would gain by shortens nothing
        (bench/size_choice, "batches of 4 rows"). Otherwise every active row: a row that ends early is refilled or
        answers its own request sooner, so all of their tokens count. At one row both are the row."""
        most = jnp.max(jnp.where(active_b, left_b, jnp.iinfo(jnp.int32).min))
        return active_b & (~self.together | (left_b == most))

    @property
    def correction(self) -> jax.Array:
        """The run-wide ratio (float32 scalar, the prior of each size's `ratios`): what this run's drafted steps
        accepted over what was predicted for their chosen sizes (1 before any)."""
        return (self.realised + RATIO_PRIOR) / (self.predicted + RATIO_PRIOR)

    @property
    def drafts(self) -> jax.Array:
        """Whether this step drafts (bool scalar)."""
        return self.skip_left <= 0

    def estimates(self, sizes: DraftSizes) -> jax.Array:
        """[k] the run's decayed mean of the accepted tokens per counted row of a step verifying each size, with the
        break-even accepts (costs - 1) weighing PRIOR steps."""
        costs_k = jnp.asarray(sizes.costs, jnp.float32)
        return (self.accepted_k + PRIOR * (costs_k - 1)) / (self.seen_k + PRIOR)

    @property
    def ratios(self) -> jax.Array:
        """[k] the factor each size's predicted accepted tokens are scaled by: what the size accepted over what was
        predicted for it in the steps that showed it, with the run-wide `correction` weighing RATIO_PRIOR predicted
        tokens (so a size no step showed yet takes the run-wide ratio)."""
        return (self.accepted_k + RATIO_PRIOR * self.correction) / (self.predicted_k + RATIO_PRIOR)

    def choose(self, accepts_k: jax.Array, lookup_k: jax.Array, sizes: DraftSizes, rows: jax.Array) -> jax.Array:
        """The index into sizes.sizes (int32 scalar) of a drafted step: the size with the most estimated tokens per
        unit of time, (1 + estimate) / cost per row (`best_size`). `accepts_k` / `lookup_k`:
        the drafters' / prompt lookup's chains' predicted accepted tokens of the `rows` counted rows (the first scaled
        by each size's `ratios`; the second, lookup's measured acceptance, is a floor)."""
        rows = jnp.maximum(rows, 1.0)
        estimate_k = jnp.maximum(self.ratios * accepts_k / rows, lookup_k / rows)
        return best_size(estimate_k, sizes)

    def skipped(self) -> "SizeChoiceState":
        """After a step that did not draft."""
        return dataclasses.replace(self, skip_left=jnp.maximum(self.skip_left - 1, 0))

    def drafted(self, sizes: DraftSizes, choice: jax.Array, accepted_k: jax.Array, rows: jax.Array,
                predicted_k: jax.Array) -> "SizeChoiceState":
        """After a drafted step of size index `choice` over `rows` counted rows: `accepted_k` [k] the tokens each size
        up to the chosen one accepted (`accepted_per_size`; the rest are not read), `predicted_k` [k] what the
        drafters predicted for each size (`predicted_accepts`, unscaled). When it verified nodes, the sizes it showed
        learn both and the others' weight decays (a step that verified the root alone teaches nothing and never
        pays); then the run's best size judged on its running mean alone (`estimates`; among the sizes shown at least
        one step's weight) decides the backoff: when its (1 + estimate) / cost loses to a plain step, the next 1, 2,
        4, ... (at most MAX_SKIP) steps skip the drafting; otherwise every step drafts."""
        shown_k = jnp.arange(len(sizes.sizes)) <= choice
        verified = jnp.asarray(sizes.sizes, jnp.int32)[choice] > 0  # index 0 is a plain step only when sizes[0] is 0
        rows = jnp.maximum(rows, 1.0)
        seen_k = jnp.where(verified, DECAY * self.seen_k + shown_k, self.seen_k)

        def learn(sum_k, step_k):
            step_k = jnp.where(shown_k, step_k / rows, 0.0)
            return jnp.where(verified, DECAY * sum_k + step_k, sum_k).astype(jnp.float32)

        state = dataclasses.replace(self, seen_k=seen_k.astype(jnp.float32),
                                    accepted_k=learn(self.accepted_k, accepted_k),
                                    predicted_k=learn(self.predicted_k, predicted_k))
        realised = jnp.where(verified, DECAY * self.realised + jnp.take(accepted_k, choice) / rows, self.realised)
        predicted = jnp.where(verified, DECAY * self.predicted + jnp.take(predicted_k, choice) / rows, self.predicted)
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


def accepted_per_size(score_bn: jax.Array, path_be: jax.Array, accept_b: jax.Array, counted_b: jax.Array,
                      sizes: DraftSizes, verified: int) -> jax.Array:
    """[k] tokens the counted rows (`counted_b`) would have accepted with each size up to `verified` nodes, from a
    step that verified the best `verified` nodes (`draft_merge.keep_best`, scores `score_bn` [b, verified] of nodes
    1..n) and accepted `accept_b` nodes along `path_be` (node indices, the root first): a size of m nodes holds the
    path's nodes ranked below m, and its path ends at the first one it lacks. Sizes above `verified`: 0."""
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
        counts.append(jnp.sum(jnp.where(counted_b, jnp.sum(kept_bd, axis=1), 0)).astype(jnp.float32))
    return jnp.stack(counts)


def predicted_accepts(proposal: TreeProposal, sizes: DraftSizes, counted_b: jax.Array) -> jax.Array:
    """[k] predicted accepted tokens of the counted rows (`counted_b`) if the best n nodes of each row are verified,
    n in sizes.sizes: the drafters' own prediction (`draft_merge.expected_accepts`)."""
    return jnp.sum(jnp.where(counted_b[:, None], expected_accepts(proposal, sizes.sizes), 0.0), axis=0)


def choose(accepts_k: jax.Array, sizes: DraftSizes, rows: jax.Array) -> jax.Array:
    """The index into sizes.sizes (int32 scalar) with the most predicted tokens of the `rows` active rows per unit
    of time, from the drafters' predictions alone (a loop whose state carries no `SizeChoiceState`): a step
    verifying n nodes per row emits rows + accepts_k[n] tokens and costs sizes.costs[n] plain steps."""
    gain_k = (rows + accepts_k) / jnp.asarray(sizes.costs, jnp.float32)
    return jnp.argmax(gain_k).astype(jnp.int32)


def lookup_pays(proposals: Sequence[TreeProposal], sizes: DraftSizes, counted_b: jax.Array) -> jax.Array:
    """Whether the mix's prompt-lookup chains alone (`proposals`: `MixedDrafter.lookup_proposals`, drafted once per
    step and reused by a drafted step; scored with lookup's measured acceptance, so uncorrected) predict a drafted
    step that beats the plain step it would replace (bool scalar; False with no lookup member): some drafted size
    n > 0 whose rows + predicted accepts per its cost exceed the rows of a plain step (cost 1; a step that skips
    the drafting costs what a plain step does, not `sizes.costs[0]`, which also pays the drafting), over the counted
    rows `counted_b`."""
    rows = jnp.sum(counted_b).astype(jnp.float32)
    drafted_k = jnp.asarray(sizes.sizes) > 0
    pays = jnp.zeros((), bool)
    for proposal in proposals:
        gain_k = (rows + predicted_accepts(proposal, sizes, counted_b)) / jnp.asarray(sizes.costs, jnp.float32)
        pays |= jnp.any(drafted_k & (gain_k > rows))
    return pays
