#!/usr/bin/env bash
# Installs everything (scripts/setup.sh) and runs the test suite on CPU. Extra arguments go to pytest
# (e.g. -m "not slow", -x, -k NAME); arguments naming tests/... run just those, in one pytest process.
#
# The whole suite runs one pytest process per test file (the small files below share a few). In a single process,
# XLA:CPU crashed (SIGSEGV in libgcc's _Unwind_Find_FDE while jaxlib threw the error status of a failed compile)
# after ~320 tests' worth of compiled executables; every file passes on its own and in any shorter run. A process
# per file keeps each process's executables to one file's worth.
#
# Most of the suite's time is XLA compiling tiny programs, each on one thread, so one file at a time leaves a
# core idle much of the time (two files at once on 2 cores: each runs ~30% slower, the suite ~1.3x faster:
# 23.4 -> 18.4 min, 2026-12-03). MEDUSA_JAX_TEST_JOBS processes (default: the number of CPUs)
# run at once, the slowest first; each one's output is printed whole when it ends. -x runs one at a time.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python}"
# checked before the install, so that a bad value stops before any work
jobs_max="${MEDUSA_JAX_TEST_JOBS:-$(nproc)}"
if ! [[ "$jobs_max" =~ ^[1-9][0-9]{0,2}$ ]] || (( jobs_max > 256 )); then
  echo "error: MEDUSA_JAX_TEST_JOBS=$jobs_max must be a whole number from 1 to 256 (pytest processes run at once); unset it to run one per CPU" >&2
  exit 2
fi
bash scripts/setup.sh
export JAX_PLATFORMS="${JAX_PLATFORMS:-cpu}"

for arg in "$@"; do
  if [[ "$arg" == tests/* || "$arg" == ./tests/* ]]; then
    exec "$PYTHON" -m pytest -q "$@"
  fi
done

stop_at_first=0
for arg in "$@"; do
  if [[ "$arg" == "-x" || "$arg" == "--exitfirst" ]]; then stop_at_first=1; jobs_max=1; fi
done
# PyTorch (the transformers references) would start one thread per CPU in each of the files running at once
if [[ $jobs_max -gt 1 ]]; then export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"; fi

# Files that compile little run together, a group to one pytest process: alone, each process's start (Python,
# pytest, JAX and the package, 1.5-3 s) costs more than their tests (the 10 "quick" files: 86 s one process each,
# 37 s together, 2026-12-03). A group stays far below the ~320 tests' executables at which one process crashed
# (above). Every other file runs in a process of its own.
declare -A groups=(
  [quick]="test_api test_bad_inputs test_bad_inputs_probe2 test_export_safety test_repo_paths test_assets test_layers
           test_atomic test_tree test_text"
  [small_a]="test_declared_once test_vocab_reduce test_drafter_kinds test_draft_merge_calibration test_eagle_recipe
             test_lm_head_rows test_stacked_load test_vocab_cut test_recycle_sampling"
  [small_b]="test_train_output test_heads_trees test_edges test_layer_updates test_cache_attention"
  [small_c]="test_calibration test_typical_rows test_attention test_dynamic_tree"
)
# Longest first (each job's time in the fresh-clone CI run of 2026-12-06 on a 2-core machine, 2 jobs at once:
# test_mixed_drafts 346 s, test_benchmark 238, test_medusa 230, test_smollm2 175, test_sharded_decode 159,
# test_serve_mesh 139, test_plan 127, test_engine_drafts 122, test_generation_engine 98, test_eagle3 91,
# test_engine_batches_direct 70, test_recycle 61), so that no long file starts last and leaves one core idle at
# the end; then any file not named here (a group by its name).
slow=(test_mixed_drafts test_benchmark test_medusa test_smollm2 test_sharded_decode test_serve_mesh test_plan
      test_engine_drafts test_generation_engine test_eagle3 test_engine_batches_direct test_recycle test_serve
      test_self_distill test_first_use test_serve_drafts test_training_run test_eagle test_drafter_choice
      test_train_memory test_exact_sampling test_loader test_stacked_cache test_decode_hlo test_hydra
      test_training_mesh test_training test_interop quick small_c small_b small_a test_refill test_cli)
jobs_list=()  # each entry: the test files of one pytest process, space-separated
declare -A job_names=()  # a group's files -> its name
add_group() {  # group $1's existing files as one job
  local files="" member
  for member in ${groups[$1]}; do [[ -f "tests/$member.py" ]] && files+="${files:+ }tests/$member.py"; done
  if [[ -n $files ]]; then jobs_list+=("$files"); job_names[$files]=$1; fi
}
for name in "${slow[@]}"; do
  if [[ -n ${groups[$name]+set} ]]; then add_group "$name"
  elif [[ -f "tests/$name.py" ]]; then jobs_list+=("tests/$name.py"); fi
done
for name in "${!groups[@]}"; do  # a group missing from the order above still runs
  [[ " ${slow[*]} " == *" $name "* ]] || add_group "$name"
done
for file in tests/test_*.py; do
  [[ " ${jobs_list[*]} " == *" $file "* ]] || jobs_list+=("$file")
done

logs="$(mktemp -d)"
trap 'rm -rf "$logs"' EXIT
# the tiny random models of tests/conftest.py, built once per run by the first file that asks and loaded by the
# rest, which then never import PyTorch (~8 s of a process's start)
export MEDUSA_JAX_TEST_FIXTURES="$logs/fixtures"
# One persistent compilation cache per run, shared by its pytest processes and the CLIs they start: most of the
# suite's time is XLA compiling, and files (and the fresh jitted closures inside one file) compile many identical
# programs. The key holds the program, the devices and XLA_FLAGS, so a hit is the executable that a compile gives.
# Per run, so a run never starts from another's executables. No size bound: with one, JAX lists and stats the whole
# folder under a file lock on every write (a run writes ~5,500 entries; listing them took 0.1 s), and a fresh-clone
# run's files took 1.6-6.5x their times of the day before (2026-12-05). Unlocked, a process that reads an entry
# another is still writing fails to decompress it, warns and compiles. (test_medusa alone: 278 -> 247 CPU s with an empty cache, 118 with a warm one, 2026-12-05.)
export JAX_COMPILATION_CACHE_DIR="$logs/jax_compile" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
job_name() {  # the log name of a job: its file's name, or its group's for files run together
  if [[ -n ${job_names[$1]+set} ]]; then echo "${job_names[$1]}"; else basename "$1" .py; fi
}
run_job() {  # one job's files in their own pytest process and temporary folder; its log and exit status under $logs
  local name; name="$(job_name "$1")"
  local rc=0
  # shellcheck disable=SC2086  # the job's files are space-separated paths without spaces
  "$PYTHON" -m pytest -q --basetemp="$logs/$name.tmp" "${@:2}" $1 >"$logs/$name.log" 2>&1 || rc=$?
  echo "$rc" >"$logs/$name.rc"
}

failed=()
report() {  # print each finished job's output once, in the order they finish
  local job name rc
  for job in "${jobs_list[@]}"; do
    name="$(job_name "$job")"
    [[ -f "$logs/$name.rc" && ! -f "$logs/$name.shown" ]] || continue
    touch "$logs/$name.shown"
    rc="$(cat "$logs/$name.rc")"
    echo "== $job"
    cat "$logs/$name.log"
    if [[ $rc -ne 0 && $rc -ne 5 ]]; then  # 5: every test of the job deselected (-m / -k)
      failed+=("$job (pytest exit $rc)")
    fi
  done
}

start=$SECONDS
for job in "${jobs_list[@]}"; do
  while [[ $(jobs -rp | wc -l) -ge $jobs_max ]]; do wait -n || true; done
  report
  [[ $stop_at_first -eq 1 && ${#failed[@]} -gt 0 ]] && break
  run_job "$job" "$@" &
done
wait || true
report
count=0
for job in "${jobs_list[@]}"; do for _ in $job; do count=$((count + 1)); done; done
echo "== $count test files in ${#jobs_list[@]} pytest processes ($jobs_max at a time) in" \
     "$(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
if [[ ${#failed[@]} -gt 0 ]]; then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
echo "all test files passed"
