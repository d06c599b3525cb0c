"""What `--model default` and `--heads default` mean in every command line: SmolLM2-135M-Instruct (`smollm2` too;
built by `demo_model.resolve_model_dir`) and the SmolLM2 heads shipped under medusa_jax/assets/heads/<name>/ with
their trees.json; any other --heads value is a folder path."""

from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

from medusa_jax.hub import hub_folder, is_hub_id

# --heads values naming heads shipped in the package (all for SmolLM2-135M-Instruct): "default" = the heads that
# accelerate most on the benchmark (bench/heads); "default-medusa" = the Medusa-1 heads, the ones PyTorch export
# (vLLM, TGI, the official Medusa code) can take
SHIPPED_HEADS = {"default": "smollm2-hydra", "default-medusa": "smollm2"}
DEFAULT_HEADS = SHIPPED_HEADS["default"]
DEFAULT_MODEL_NAMES = ("default", "smollm2")  # --model values meaning SmolLM2-135M-Instruct ("default" documented)


def is_default_model(arg: str | os.PathLike) -> bool:
    return str(arg) in DEFAULT_MODEL_NAMES


def shipped_heads_dir(name: str = DEFAULT_HEADS) -> Path:
    """The folder of the shipped heads `name` (it may be missing in a source checkout without them)."""
    return Path(str(importlib.resources.files("medusa_jax"))) / "assets" / "heads" / name


def resolve_heads_dir(arg: str | os.PathLike, flag: str = "--heads") -> Path:
    """'default' / 'default-medusa' -> shipped SmolLM2 heads (SHIPPED_HEADS); a Hub id `ORG/NAME` that is no
    local path -> its folder in the Hugging Face cache (published Medusa heads, `medusa_jax.hub`); anything else
    -> that folder. Raises FileNotFoundError (HubError is one), its message naming `flag` where the folder is local."""
    if str(arg) in SHIPPED_HEADS:
        folder = shipped_heads_dir(SHIPPED_HEADS[str(arg)])
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{flag} {arg}: no shipped heads at {folder}; train them with the command "
                                    f"in docs/training.md, or pass a heads folder")
        return folder
    if is_hub_id(arg):
        return hub_folder(str(arg), kind="heads")
    folder = Path(arg)
    if not folder.is_dir():
        raise FileNotFoundError(f"{flag} {folder}: heads folder does not exist")
    return folder
