"""The drafter kinds: one registry of classes by name (heads.kinds), one of training objectives by the same names
(training.objectives), and the places that used to switch on the kind's name reading them instead."""

from types import SimpleNamespace

import pytest
from flax import nnx

from medusa_jax.model.config import ModelConfig
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.kinds import DRAFTERS, drafter_class, heads_class, training_free_kinds
from medusa_jax.heads.lookup import LookupDrafter
from medusa_jax.heads.medusa import MedusaHeads
from medusa_jax.heads.recycle import RecycleDrafter
from medusa_jax.inference.mixed_decoding import is_mix, make_members, parse_mix
from medusa_jax.training.objectives import OBJECTIVES, objective_for
from medusa_jax.scripts.train_heads import build_parser


def test_every_kind_registers_under_its_own_name_and_every_objective_names_a_kind():
    assert {name: cls.head_type for name, cls in DRAFTERS.items()} == {name: name for name in DRAFTERS}
    assert set(OBJECTIVES) <= set(DRAFTERS)
    assert drafter_class("hydra") is DRAFTERS["hydra"]
    with pytest.raises(ValueError, match="head_type must be one of .*'medusa'.*got 'bogus'"):
        drafter_class("bogus")


def test_the_trainer_command_offers_exactly_the_trainable_kinds():
    action = next(a for a in build_parser()._actions if "--head-type" in a.option_strings)
    assert tuple(action.choices) == tuple(OBJECTIVES)


def test_each_kind_answers_for_its_data_needs_and_layouts():
    """What the head_type switches said, now said by each kind."""
    assert [k for k in OBJECTIVES if objective_for(k).joint_backbone] == ["medusa"]  # Medusa-2 for Medusa heads only
    assert [k for k in OBJECTIVES if objective_for(k).path_tokens] == ["hydra"]
    assert [k for k in OBJECTIVES if objective_for(k).feature_rows] == ["eagle"]
    assert MedusaHeads.export_formats == ("medusa", "vllm") and DRAFTERS["hydra"].export_formats == ()
    assert EagleDrafter.export_formats == ("eagle", "eagle-sglang") and EagleDrafter.has_decoder
    heads = MedusaHeads(HeadsConfig(16, 32, num_heads=2, num_layers=1), nnx.Rngs(0))
    assert heads.folder_fields() == {"medusa_num_heads": 2, "medusa_num_layers": 1}


def test_a_decoder_config_belongs_to_the_eagle_drafter_only():
    decoder = ModelConfig("llama", vocab_size=32, hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                          num_kv_heads=1, head_dim=8)
    with pytest.raises(ValueError, match="only an eagle drafter has a decoder config"):
        MedusaHeads(HeadsConfig(16, 32, decoder=decoder), nnx.Rngs(0))
    drafter = EagleDrafter(HeadsConfig(16, 32, num_heads=2, head_type="eagle", decoder=decoder), nnx.Rngs(0))
    assert drafter.lm_head_modules() == [drafter]


def test_the_training_free_kinds_are_registered_and_answer_for_themselves():
    """Token Recycling and prompt lookup are kinds of the one registry; an unknown name is one error line."""
    assert training_free_kinds() == ("recycle", "lookup")
    assert DRAFTERS["recycle"] is RecycleDrafter and DRAFTERS["lookup"] is LookupDrafter
    assert [k for k, c in DRAFTERS.items() if c.trained] == ["medusa", "hydra", "eagle", "eagle3"]
    assert [k for k, c in DRAFTERS.items() if c.decodes_alone] == ["medusa", "hydra", "eagle", "eagle3", "recycle"]
    # the mesh's per-shard top-k (inference/sharded.py) is asked of the drafter, not of its type
    assert [k for k, c in DRAFTERS.items() if getattr(c, "proposes_top_k_of_logits", False)] == ["medusa"]
    with pytest.raises(ValueError) as error:
        drafter_class("recycel")
    assert "\n" not in str(error.value) and "'recycel'" in str(error.value) and "'lookup'" in str(error.value)
    with pytest.raises(ValueError, match="head_type must be one of .*'eagle3'\\), got 'lookup'"):
        heads_class("lookup")  # a heads folder cannot claim a training-free kind


class EchoDrafter(LookupDrafter):
    """A stand-in new training-free kind: one class, one registration."""

    head_type = "echo"


def test_a_new_training_free_kind_is_one_registration_away_from_the_mix_parser(monkeypatch):
    monkeypatch.setitem(DRAFTERS, "echo", EchoDrafter)
    assert parse_mix("default+echo+lookup") == (("echo", "lookup"), "default") and is_mix("echo")
    base = SimpleNamespace(config=SimpleNamespace(hidden_size=8, vocab_size=32))
    mix = make_members(base, ("echo", "lookup"), None, 16)
    assert mix.names == ("echo", "lookup") and isinstance(mix.drafters[0], EchoDrafter)
    # echo's and lookup's 4 chains of 10 each (LookupDrafter.mix_member at 16 nodes)
    assert mix.candidates == 80 and mix.depth == 10
