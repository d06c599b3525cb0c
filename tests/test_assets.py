"""The heads shipped in the package: `--heads default` resolves to them and they fit SmolLM2."""

from __future__ import annotations

import pytest

from medusa_jax.assets import SHIPPED_HEADS, resolve_heads_dir, shipped_heads_dir
from medusa_jax.heads.folder import load_native_heads


@pytest.mark.parametrize("name, head_type", [("default", "hydra"), ("default-medusa", "medusa")])
def test_default_names_resolve_to_the_shipped_smollm2_heads(name, head_type):
    folder = resolve_heads_dir(name)
    assert folder == shipped_heads_dir(SHIPPED_HEADS[name])
    assert sum(p.stat().st_size for p in folder.iterdir()) <= 20 * 1024 * 1024  # the package budget
    heads = load_native_heads(folder)
    assert (heads.config.hidden_size, heads.config.vocab_size) == (576, 49152)  # SmolLM2-135M
    assert heads.config.dtype == "float32"  # stored as float16, computed in float32
    assert heads.config.head_type == head_type  # default = Hydra (accelerates most); default-medusa exports


def test_other_values_are_folders(tmp_path):
    assert resolve_heads_dir(tmp_path) == tmp_path
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_heads_dir(tmp_path / "missing")
