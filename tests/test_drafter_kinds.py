"""The drafter kinds: one registry of classes by name (heads.kinds), one of training objectives by the same names
(training.objectives), and the places that used to switch on the kind's name reading them instead."""

import pytest
from flax import nnx

from medusa_jax.model.config import ModelConfig
from medusa_jax.heads.config import HeadsConfig
from medusa_jax.heads.eagle import EagleDrafter
from medusa_jax.heads.kinds import DRAFTERS, drafter_class
from medusa_jax.heads.medusa import MedusaHeads
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
