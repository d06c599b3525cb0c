#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the test suite on CPU. Extra arguments go to pytest
# (e.g. -m "not slow", -x, -k NAME); arguments naming tests/... run just those, in one pytest process.
#
# The whole suite runs one pytest process per test file. In a single process, XLA:CPU crashed (SIGSEGV in
# libgcc's _Unwind_Find_FDE while jaxlib threw the error status of a failed compile) after ~320 tests' worth
# of compiled executables; every file passes on its own and in any shorter run. A process per file keeps each
# process's executables to one file's worth (about 3 minutes more in all for imports and fixtures).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

for arg in "$@"; do
  if [[ "$arg" == tests/* || "$arg" == ./tests/* ]]; then
    exec "$PYTHON" -m pytest -q "$@"
  fi
done

stop_at_first=0
for arg in "$@"; do
  [[ "$arg" == "-x" || "$arg" == "--exitfirst" ]] && stop_at_first=1
done

failed=()
files=(tests/test_*.py)
start=$SECONDS
for file in "${files[@]}"; do
  echo "== $file"
  rc=0
  "$PYTHON" -m pytest -q "$@" "$file" || rc=$?
  if [[ $rc -ne 0 && $rc -ne 5 ]]; then  # 5: every test of the file deselected (-m / -k)
    failed+=("$file (pytest exit $rc)")
    [[ $stop_at_first -eq 1 ]] && break
  fi
done
echo "== ${#files[@]} test files in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test files passed"
