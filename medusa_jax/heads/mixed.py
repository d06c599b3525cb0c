"""Mixed drafts: several drafters (trained heads, prompt lookup, ...) propose into ONE tree per step and row
(`MixedDrafter`, the drafter contract of `heads.medusa.HeadsBase` over a list of drafters; how members propose,
merge and keep their states: docs/modules.md). `config` is the trained heads' config, or, with no trained
drafter, a stand-in with the base's sizes and `num_heads` = the deepest draft."""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.draft_merge import DraftSizes, keep_best, merge_proposals
from medusa_jax.trees.dynamic_tree import TreeProposal
from medusa_jax.heads.lookup import LookupConfig, LookupDrafter, lookup_proposal
from medusa_jax.heads.merge_calibration import MemberCalibration, calibration_for
from medusa_jax.trees.tree import DynamicTree, TreeBuffers


@dataclasses.dataclass(frozen=True)
class TemplateSpec:
    """A static template a drafter fills ([b, t] tokens) and each node's log predicted acceptance."""

    tree: TreeBuffers
    score_t: tuple[float, ...]  # node 0 (the root) first

    @property
    def depth(self) -> int:
        return self.tree.depth

    @property
    def nodes(self) -> int:
        return self.tree.num_tokens - 1

    def proposal(self, tokens_bt: jax.Array) -> TreeProposal:
        b, t = tokens_bt.shape
        rows = lambda x: jnp.broadcast_to(jnp.asarray(x), (b, t))  # noqa: E731
        return TreeProposal(tokens_bt.astype(jnp.int32), rows(np.asarray(self.tree.parent_t, np.int32)),
                            rows(np.asarray(self.tree.depth_t, np.int32)), rows(np.asarray(self.score_t, np.float32)))


def template_spec(tree: TreeBuffers, rank_acceptance: tuple[float, ...]) -> TemplateSpec:
    """A template whose node (parent, rank r) is accepted with probability rank_acceptance[r] given its parent."""
    score = [0.0] * tree.num_tokens
    for t in range(1, tree.num_tokens):
        score[t] = score[int(tree.parent_t[t])] + math.log(rank_acceptance[int(tree.rank_t[t])])
    return TemplateSpec(tree, tuple(score))


def prompt_readers(drafters: Sequence[nnx.Module]) -> tuple[bool, ...]:
    """Which members the mix gives the prompt's hidden states: those that need them (`needs_prompt_hidden`), except
    one that reads them only to learn the prompt (`learns_prompt`: Token Recycling's table refresh from the
    prompt's logits) when another member drafts from the prompt's own tokens (`drafts_from_prompt`: prompt
    lookup). Measured on SmolLM2 (bench/mixed_drafts/prompt_refresh): beside lookup the refresh gained no tokens per
    step and cost the first token a vocabulary projection per distinct prompt token; alone it gains."""
    from_prompt = any(getattr(d, "drafts_from_prompt", False) for d in drafters)
    return tuple(bool(getattr(d, "needs_prompt_hidden", False))
                 and not (from_prompt and getattr(d, "learns_prompt", False)) for d in drafters)


class MixedDrafter(nnx.Module):
    def __init__(self, drafters: Sequence[nnx.Module], specs: Sequence[DynamicTree | TemplateSpec | None],
                 names: Sequence[str], config: HeadsConfig,
                 calibrations: Sequence[MemberCalibration | None] | None = None):
        if not drafters or len(drafters) != len(specs) or len(names) != len(drafters):
            raise ValueError("a mix needs one or more drafters, each with a spec and a name")
        if calibrations is not None and len(calibrations) != len(drafters):
            raise ValueError("a mix's calibrations: one per drafter (None: its own scores)")
        tapped = [name for name, d in zip(names, drafters) if getattr(d, "feature_layers", ())]
        if tapped:  # the mix's verify forward gives every member the final hidden states
            raise ValueError(f"{', '.join(tapped)}: a drafter that reads the base's inner layers (EAGLE-3) cannot "
                             f"join a mix yet; use it alone")
        self.drafters = nnx.List(list(drafters))
        self.specs = tuple(specs)
        self.names = tuple(names)
        self.config = config
        # how each member's scores are calibrated in the merge (default: the shipped counts of its kind)
        self.calibrations = tuple(calibrations) if calibrations is not None else tuple(
            calibration_for(name) for name in names)
        self.prompt_readers = prompt_readers(drafters)
        self.needs_prompt_hidden = any(self.prompt_readers)
        self.keeps_draft = any(getattr(d, "keeps_draft", False) for d in drafters)
        self.feature_layers = ()  # every member reads the final hidden states (no EAGLE-3 taps)

    @property
    def depth(self) -> int:
        """The deepest path any drafter proposes."""
        return max(spec.depth if spec is not None else drafter.depth
                   for drafter, spec in zip(self.drafters, self.specs))

    @property
    def candidates(self) -> int:
        """Candidate nodes proposed per step and row, before deduplication (the largest useful draft size)."""
        return sum(spec.nodes if spec is not None else drafter.num_nodes
                   for drafter, spec in zip(self.drafters, self.specs))

    def init_draft(self, base, prompt_bt, prompt_lens_b, hidden_btd, cache_size: int, max_depth: int):
        """Each member's state from the prompt; the prompt's hidden states go to the `prompt_readers` only."""
        return tuple(drafter.init_draft(base, prompt_bt, prompt_lens_b, hidden_btd if reads else None, cache_size,
                                        max_depth if spec is None else spec.depth)
                     for drafter, spec, reads in zip(self.drafters, self.specs, self.prompt_readers))

    def propose(self, hidden_bd, root_b, base, tree: DraftSizes, draft, active_b,
                given: dict[int, TreeProposal] | None = None):
        """The merged candidate tree of the step's largest size and the members' new states; `given`: proposals
        already drafted this step by member index (`lookup_proposals`: the step's size choice read them first),
        not drafted again."""
        if not isinstance(tree, DraftSizes):
            raise ValueError(f"mixed drafts decode with draft sizes (draft_merge.DraftSizes), got {tree!r}")
        proposals, states = self.member_proposals(hidden_bd, root_b, base, draft, active_b, given)
        merged = merge_proposals(proposals, tree.depth, self.calibrations)
        return keep_best(merged, tree.nodes), states

    def lookup_proposals(self, draft, root_b) -> dict[int, TreeProposal]:
        """The prompt-lookup members' proposals by member index: matching only, no model call, so the step drafts
        them before it decides whether to draft at all (`size_choice.lookup_pays`) and hands them to `propose`.
        Lookup's state is unchanged by proposing."""
        return {i: lookup_proposal(drafter.lookup, state, root_b)
                for i, (drafter, state) in enumerate(zip(self.drafters, draft)) if isinstance(drafter, LookupDrafter)}

    def member_proposals(self, hidden_bd, root_b, base, draft, active_b,
                         given: dict[int, TreeProposal] | None = None) -> tuple[list[TreeProposal], tuple]:
        """Each member's own candidate tree (scored with its own log predicted acceptance) and new state (a
        member in `given` keeps its state and the given proposal)."""
        proposals, states = [], []
        for i, (drafter, spec, state) in enumerate(zip(self.drafters, self.specs, draft)):
            if given and i in given:
                proposal = given[i]
            elif isinstance(spec, TemplateSpec):
                tokens_bt, state = drafter.propose(hidden_bd, root_b, base, spec.tree, state, active_b)
                proposal = spec.proposal(tokens_bt)
            else:
                proposal, state = drafter.propose(hidden_bd, root_b, base, spec, state, active_b)
            proposals.append(proposal)
            states.append(state)
        return proposals, tuple(states)

    def accepted(self, draft, hidden_btd, tokens_bt, nodes_be, accept_b, active_b):
        return tuple(drafter.accepted(state, hidden_btd, tokens_bt, nodes_be, accept_b, active_b)
                     for drafter, state in zip(self.drafters, draft))

    def verified(self, draft, tokens_bt, logits_btv, active_b):
        return tuple(drafter.verified(state, tokens_bt, logits_btv, active_b) if hasattr(drafter, "verified")
                     else state for drafter, state in zip(self.drafters, draft))

    def keep_draft(self, draft) -> None:
        """The states a decode call ended with, for the drafters that keep theirs across calls."""
        for drafter, state in zip(self.drafters, draft):
            if getattr(drafter, "keeps_draft", False):
                drafter.keep_draft(state)


def stand_in_config(hidden_size: int, vocab_size: int, depth: int) -> HeadsConfig:
    """The config of a mix with no trained drafter (module docstring)."""
    return HeadsConfig(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=depth, num_layers=0,
                       lm_head="shared")


def make_mix(hidden_size: int, vocab_size: int, *, trained: nnx.Module | None = None,
             trained_tree: DynamicTree | None = None, lookup: LookupConfig | None = None,
             template: tuple[nnx.Module, TemplateSpec] | None = None) -> MixedDrafter:
    """A mix of trained heads (Medusa or Hydra, drafting the dynamic tree `trained_tree`), a template drafter
    (Token Recycling and its `template_spec`) and prompt lookup (`lookup`); any may be left out."""
    drafters, specs, names = [], [], []
    if template is not None:
        drafters.append(template[0])
        specs.append(template[1])
        names.append(template[0].head_type)
    if trained is not None:
        if trained_tree is None:
            raise ValueError("trained heads in a mix need their dynamic tree (trained_tree)")
        drafters.append(trained)
        specs.append(trained_tree.check(trained.config.num_heads, trained.config.head_vocab_size))
        names.append(trained.config.head_type)
    if lookup is not None:
        drafters.append(LookupDrafter(lookup))
        specs.append(None)
        names.append("lookup")
    depth = max(spec.depth if spec is not None else d.depth for d, spec in zip(drafters, specs)) if drafters else 0
    config = trained.config if trained is not None else stand_in_config(hidden_size, vocab_size, depth)
    return MixedDrafter(drafters, specs, names, config)
