"""How a mixed-draft step chooses its draft size, inside the jitted decode loop: whether to draft at all (a backoff
that a run of steps where drafting did not pay turns off for a while; prompt lookup's own chains override it),
and which of the static sizes to verify (predicted tokens per unit of time). Why, and the rule at batch > 1:
docs/modules.md."""

from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp

from medusa_jax.heads.draft_merge import DraftSizes, expected_accepts
from medusa_jax.trees.dynamic_tree import TreeProposal

MAX_SKIP = 8  # the longest run of steps without drafting after drafted steps that did not pay
# the run's correction of the drafters' predicted accepted tokens (`SizeChoiceState.correction`): a start of
# CORRECTION_PRIOR tokens both realised and predicted (ratio 1), each drafted step's weighing DECAY of the earlier ones
CORRECTION_PRIOR = 1.0
CORRECTION_DECAY = 0.9


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SizeChoiceState:
    """Carried through the decode loop (scalars, one per batch)."""

    skip_left: jax.Array  # int32: steps still to run without drafting
    misses: jax.Array  # int32: drafted steps in a row that did not pay
    realised: jax.Array  # float32: accepted tokens of this run's drafted steps of size > 0 (decayed sum)
    predicted: jax.Array  # float32: the tokens the drafters predicted for those steps (decayed sum)

    @staticmethod
    def start() -> "SizeChoiceState":
        return SizeChoiceState(jnp.zeros((), jnp.int32), jnp.zeros((), jnp.int32),  # own buffers: calls donate them
                               jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32))

    @property
    def correction(self) -> jax.Array:
        """The factor `choose` scales the predicted accepted tokens by (float32 scalar): what this run's drafted
        steps accepted over what was predicted for them (1 before any)."""
        return (self.realised + CORRECTION_PRIOR) / (self.predicted + CORRECTION_PRIOR)

    @property
    def drafts(self) -> jax.Array:
        """Whether this step drafts (bool scalar)."""
        return self.skip_left <= 0

    def skipped(self) -> "SizeChoiceState":
        """After a step that did not draft."""
        return dataclasses.replace(self, skip_left=jnp.maximum(self.skip_left - 1, 0))

    def drafted(self, sizes: DraftSizes, choice: jax.Array, accepted: jax.Array, rows: jax.Array,
                predicted: jax.Array) -> "SizeChoiceState":
        """After a drafted step of size index `choice` that accepted `accepted` tokens over `rows` active rows
        where the drafters predicted `predicted` (uncorrected; scalars): a step pays when its rows + accepted
        tokens beat the rows tokens plain steps give in its time (`sizes.costs[choice]` plain steps; a drafted
        step that verified no node never pays: it paid for the drafting). A step that verified nodes also updates
        the correction."""
        cost = jnp.asarray(sizes.costs, jnp.float32)[choice]
        verified = jnp.asarray(sizes.sizes, jnp.int32)[choice] > 0  # index 0 is a plain step only when sizes[0] is 0
        pays = verified & (rows + accepted >= rows * cost)
        misses = jnp.where(pays, 0, self.misses + 1)
        skip = jnp.where(pays, 0, jnp.minimum(jnp.left_shift(1, jnp.clip(misses - 1, 0, 8)), MAX_SKIP))
        realised = jnp.where(verified, CORRECTION_DECAY * self.realised + accepted, self.realised)
        predicted = jnp.where(verified, CORRECTION_DECAY * self.predicted + predicted, self.predicted)
        return SizeChoiceState(skip.astype(jnp.int32), misses.astype(jnp.int32), realised.astype(jnp.float32),
                               predicted.astype(jnp.float32))


def predicted_accepts(proposal: TreeProposal, sizes: DraftSizes, active_b: jax.Array) -> jax.Array:
    """[k] predicted accepted tokens of all active rows if the best n nodes of each row are verified, n in
    sizes.sizes: the drafters' own prediction (`draft_merge.expected_accepts`)."""
    return jnp.sum(jnp.where(active_b[:, None], expected_accepts(proposal, sizes.sizes), 0.0), axis=0)


def choose(accepts_k: jax.Array, sizes: DraftSizes, rows: jax.Array, correction: jax.Array | float = 1.0
           ) -> jax.Array:
    """The index into sizes.sizes (int32 scalar) with the most predicted tokens of the `rows` active rows per unit
    of time: a step verifying n nodes per row emits rows + correction * accepts_k[n] tokens and costs
    sizes.costs[n] plain steps (`correction`: `SizeChoiceState.correction`)."""
    gain_k = (rows + correction * accepts_k) / jnp.asarray(sizes.costs, jnp.float32)
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
