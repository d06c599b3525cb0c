"""The compiled decode step's memory traffic follows the work (issue: batched decode that scales).

Timing tests are flaky on shared machines, so these read the compiler's own output instead:
- the compiled plain and Medusa decode loops hold no copy, transpose or broadcast as large as one layer's K or
  V buffer (the cache is updated in place and the attention dots read it in the layout it is stored in);
- attention accesses bytes (XLA's cost analysis) in proportion to the slots it reads: doubling the slots or
  the rows at most doubles the bytes, and the total stays close to one read of K and V (re-laying K/V for
  the dots, or materialising them once per query group as a GQA broadcast would, fails);
- a narrow prefill runs only the width it takes: the work of its one-trip loops (`autoregressive.run_if`) stays
  inside them, no matrix product outside.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from medusa_jax.model.attention import grouped_attention
from medusa_jax.model.backbone import CausalLM
from medusa_jax.model.config import ModelConfig
from medusa_jax.model.kv_cache import KVCache
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.draft_merge import DraftSizes
from medusa_jax.heads.lookup import LookupConfig
from medusa_jax.heads.medusa import MedusaHeads, MedusaModel
from medusa_jax.heads.mixed import make_mix, template_spec
from medusa_jax.heads.recycle import RANK_ACCEPTANCE, RecycleConfig, RecycleDrafter, template_tree
from medusa_jax.trees.tree import DynamicTree, build_tree, load_tree
from medusa_jax.inference.acceptance import GREEDY
from medusa_jax.inference.autoregressive import decode, narrow_prefill_states, prefill_widths
from medusa_jax.inference.medusa import heads_proposer, medusa_decode
from medusa_jax.inference.sampling import SamplingConfig

CFG = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                  num_heads=6, num_kv_heads=2, head_dim=16)
_OP = re.compile(r"= (\w+)\[([\d,]*)\]\{[^}]*\} (copy|transpose|broadcast)\(")


def _cache_copies(hlo: str, slots: int, batch: int) -> list[str]:
    """copy/transpose/broadcast instructions over cache slots (a slots and a head-width axis) holding at least
    one layer's K or V: a re-laid copy of a layer, or K/V materialised once per query group."""
    one_layer = batch * slots * CFG.num_kv_heads * CFG.head_dim
    found = []
    for line in hlo.splitlines():
        m = _OP.search(line)
        if m:
            dims = [int(x) for x in filter(None, m.group(2).split(","))]
            n = 1
            for x in dims:
                n *= x
            if slots in dims and CFG.head_dim in dims and n >= one_layer:
                found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("batch, slots, groups", [(1, 512, 1), (4, 256, 1), (12, 1024, 3)])
def test_decode_loops_hold_no_copy_of_the_whole_cache(batch, slots, groups):
    """... with the prefill in length groups too (groups > 1: a fori_loop that scatters each group's fresh
    K/V into its rows of the carried cache)."""
    model = CausalLM(CFG, nnx.Rngs(0))
    cache = KVCache.zeros(CFG, batch, slots)
    prompts = jnp.zeros((batch, 64 * groups), jnp.int32)
    lengths = jnp.full((batch,), 10, jnp.int32)
    graphdef, params = nnx.split(model)
    plain = decode.lower(graphdef, params, cache, prompts, lengths, jax.random.key(0), max_new_tokens=8,
                         sampling=SamplingConfig(), eos_ids=(), pad_id=0, prefill_groups=groups).compile().as_text()
    assert _cache_copies(plain, slots, batch) == []
    heads = MedusaHeads(HeadsConfig(num_heads=4, num_layers=1, hidden_size=CFG.hidden_size,
                                    vocab_size=CFG.vocab_size), nnx.Rngs(1))
    graphdef, params = nnx.split(MedusaModel(model, heads))
    # a 4-token chain is the kind of tree build_tree picks on CPU; with it (and not with mc_sim_7b_8) the loop
    # copied every layer's whole K and V each step while the accepted path's move came after the verify's
    # attention reads (it is now made at the start of the next step)
    # a dynamic tree builds its mask and paths per row on device: it must not copy the cache either
    for tree in (load_tree("mc_sim_7b_8", num_heads=4), build_tree([[0], [0, 0], [0, 0, 0]], num_heads=4),
                 DynamicTree(8, 3, 3)):
        medusa = medusa_decode.lower(graphdef, params, cache, prompts, lengths, jax.random.key(0), None, tree=tree,
                                     max_new_tokens=8, acceptance=GREEDY, eos_ids=(), pad_id=0,
                                     proposer=heads_proposer, prefill_groups=groups).compile().as_text()
        assert _cache_copies(medusa, slots, batch) == [], tree.name


def test_mixed_draft_loop_holds_no_copy_of_the_whole_cache():
    """Mixed drafts choose one of several static sizes per step: each size's branch writes the cache in place
    (`medusa.run_if`; a lax.switch copied every layer's K and V twice per step)."""
    batch, slots = 1, 512
    model = CausalLM(CFG, nnx.Rngs(0))
    recycler = RecycleDrafter(RecycleConfig(CFG.hidden_size, CFG.vocab_size))
    mix = make_mix(CFG.hidden_size, CFG.vocab_size, lookup=LookupConfig(length=6),
                   template=(recycler, template_spec(template_tree("recycle_4"), RANK_ACCEPTANCE)))
    graphdef, params = nnx.split(MedusaModel(model, mix))
    sizes = DraftSizes((0, 1, 3, 10), (1.0, 1.3, 1.5, 2.0), depth=mix.depth)
    hlo = medusa_decode.lower(graphdef, params, KVCache.zeros(CFG, batch, slots), jnp.zeros((batch, 64), jnp.int32),
                              jnp.full((batch,), 10, jnp.int32), jax.random.key(0), None, tree=sizes,
                              max_new_tokens=8, acceptance=GREEDY, eos_ids=(), pad_id=0,
                              proposer=heads_proposer).compile().as_text()
    assert _cache_copies(hlo, slots, batch) == []


_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%?(\S+) = (.*)$")
_CALLED = re.compile(r"(?:calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")


def _computations(hlo: str) -> dict[str, list[tuple[str, str, list[str]]]]:
    """name -> its instructions (name, opcode, the computations it calls) in an HLO module's text."""
    comps, current = {}, None
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and line.rstrip().endswith("{"):
            current = line.split(" ")[1 if line.startswith("ENTRY") else 0].lstrip("%")
            comps[current] = []
            continue
        m = _INSTRUCTION.match(line)
        if m and current is not None:
            rest, depth = m.group(2), 0
            for i, ch in enumerate(rest):  # past the shape, a tuple's "(...)" included
                depth += (ch == "(") - (ch == ")")
                if ch == " " and depth == 0:
                    break
            called = _CALLED.findall(line) + [c.strip().lstrip("%") for b in _BRANCHES.findall(line)
                                              for c in b.split(",")]
            comps[current].append((m.group(1), rest[i + 1:].split("(", 1)[0], called))
    return comps


def _reach(comps: dict, comp: str, seen: set, through_while: bool = True) -> set:
    """The computations `comp` runs (itself included), those of its while loops only `through_while`."""
    if comp not in seen:
        seen.add(comp)
        for _, op, called in comps.get(comp, []):
            if through_while or op != "while":
                for c in called:
                    _reach(comps, c, seen, through_while)
    return seen


def _dots_outside_trips(hlo: str) -> list[str]:
    """The matrix products that run whatever the one-trip loops (`run_if`) of the entry computation decide: its
    own instructions, not those of its while loops, that are or call a dot."""
    comps = _computations(hlo)
    comp = next(line.split(" ")[1].lstrip("%") for line in hlo.splitlines() if line.startswith("ENTRY"))

    def dot(op: str, called: list[str]) -> bool:
        inner = set().union(*(_reach(comps, c, set(), through_while=False) for c in called)) if op != "while" \
            else set()
        return op in ("dot", "convolution") or any(o in ("dot", "convolution") for c in inner
                                                    for _, o, _ in comps.get(c, []))

    return [f"{name} ({op})" for name, op, called in comps[comp] if dot(op, called)]


def test_narrow_prefill_runs_only_the_width_it_takes():
    """`narrow_prefill_states` runs one width's prefill (a `run_if` each): the prompt reaches each width as an
    operand, so XLA cannot hoist the first layer's projections of every width out of them."""
    model = CausalLM(CFG, nnx.Rngs(0))
    graphdef, params = nnx.split(model)

    def prefill(params_, prompt_bt, lens_b, cache):
        return narrow_prefill_states(nnx.merge(graphdef, params_), prompt_bt, lens_b, cache)

    assert len(prefill_widths(512)) > 1
    hlo = jax.jit(prefill).lower(params, jnp.zeros((2, 512), jnp.int32), jnp.full((2,), 10, jnp.int32),
                                 KVCache.zeros(CFG, 2, 640)).compile().as_text()
    assert _dots_outside_trips(hlo) == []


def _attention_bytes(rows: int, slots: int, tokens: int = 1) -> tuple[float, int]:
    kv, group, d = CFG.num_kv_heads, CFG.num_heads // CFG.num_kv_heads, CFG.head_dim
    q = jax.ShapeDtypeStruct((rows, tokens, kv, group, d), jnp.float32)
    k = jax.ShapeDtypeStruct((rows, kv, d, slots), jnp.float32)
    v = jax.ShapeDtypeStruct((rows, kv, slots, d), jnp.float32)
    mask = jax.ShapeDtypeStruct((rows, tokens, slots), jnp.bool_)
    compiled = jax.jit(grouped_attention).lower(q, k, v, mask).compile()
    return compiled.cost_analysis()["bytes accessed"], 2 * rows * slots * kv * d * 4


@pytest.mark.parametrize("tokens", [1, 16])
def test_attention_bytes_grow_with_the_slots_read(tokens):
    base, kv_bytes = _attention_bytes(8, 256, tokens)
    more_slots, _ = _attention_bytes(8, 512, tokens)
    more_rows, _ = _attention_bytes(16, 256, tokens)
    assert more_slots <= 2.1 * base and more_rows <= 2.1 * base
    # K and V read once by the dots: 1 pass; the softmax makes up to ~10 passes over the scores. Re-laying K/V
    # for the dots (a transpose reads and writes them, then the dot reads them) needs 3 passes, a copy of K/V
    # per query group (x3 here) more.
    assert base <= 1.5 * kv_bytes + 10 * (8 * 256 * tokens * CFG.num_heads * 4), (base, kv_bytes)
