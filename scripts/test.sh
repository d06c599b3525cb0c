#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the test suite on CPU. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"
"$PYTHON" -m pytest -q "$@"
