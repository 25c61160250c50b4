#!/usr/bin/env bash
# Everything measured on a lent GPU machine, in one call, each part under a
# time limit of its own so that one slow part leaves the others their time:
#
#     OUT=/some/dir bash benchmarks/experiments/gpu_run.sh
#     QUICK=1 OUT=/some/dir bash benchmarks/experiments/gpu_run.sh   # smoke run
#     PARTS=hlo,tests OUT=/some/dir bash benchmarks/experiments/gpu_run.sh
#
# 1. the versions and the card;
# 2. `gpu_steps` (single table, DLRM, the rules' optimizer steps);
# 3. `hashed_table`'s train step and `assign`/`find` (the default eviction);
# 4. `profile_step` on the GPU: op counts of the compiled 26-table step
#    (conditionals, copies) and its memory analysis;
# 5. `hashed_step_hlo`: which part of the hashed step copies the id table;
# 6. `dedup_variants_gpu`: XLA's ways of deduplicating ids, timed;
# 7. the test suite, except the parts that test the CPU (the C++ kernels'
#    build, cache and trust checks, huge pages, the notebooks), on 8 workers,
#    its outcome per test in `$OUT/junit.xml`.
# Logs and JSON go to $OUT; the reply's tail shows the summaries.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?set OUT to the folder for the results}"
export PYTHONPATH="$PWD" PYTHONUNBUFFERED=1
if [ "${QUICK:-0}" = 1 ]; then
  quick=--quick; limit=1
else
  quick=; limit=0
fi
parts=",${PARTS:-gpu_steps,hashed,profile,hlo,dedup,tests},"
part() {  # part NAME SECONDS COMMAND...: one part, its log in $OUT/NAME.log
  local name=$1 seconds=$2; shift 2
  [[ $parts == *",$name,"* ]] || return 0
  local t0=$SECONDS
  timeout -s INT -k 20 "$seconds" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: exit $? in $((SECONDS - t0)) s"
}
nvidia-smi -L 2>&1 | head -2
python3 -c 'import jax, optax, chex, numpy; print("jax", jax.__version__,
"optax", optax.__version__, "chex", chex.__version__, "numpy",
numpy.__version__, jax.devices())'
part gpu_steps 180 python3 -m benchmarks.experiments.gpu_steps $quick \
  --out "$OUT/gpu_steps.json"
grep -v '^{' "$OUT/gpu_steps.log" 2>/dev/null | tail -40
part hashed 90 python3 -m benchmarks.experiments.hashed_table $quick \
  --skip fbgemm,init
grep -v '^{' "$OUT/hashed.log" 2>/dev/null | tail -8
dims=()
[ "$limit" = 1 ] && dims=(--rows 10000 --cap 10000 --steps 3 --warmup 1)
JAX_PLATFORMS="${JAX_PLATFORMS:-cuda}" part profile 80 \
  python3 -m benchmarks.experiments.profile_step "${dims[@]}" \
  --out "$OUT/profile"
tail -30 "$OUT/profile.log" 2>/dev/null
part hlo 60 python3 -m benchmarks.experiments.hashed_step_hlo \
  --out "$OUT/hlo" ${quick:+--capacity 20000}
cat "$OUT/hlo.log" 2>/dev/null | grep -v WARNING | tail -20
part dedup 90 python3 -m benchmarks.experiments.dedup_variants_gpu $quick
grep -v '^{' "$OUT/dedup.log" 2>/dev/null | tail -12
tests=(tests lazy_optax --ignore=tests/test_kernel_cache.py
  --ignore=tests/test_kernel_shards.py --ignore=tests/test_huge_pages.py
  --ignore=tests/test_colabs.py --ignore=tests/test_cpu_kernel.py)
[ "$limit" = 1 ] && tests=(tests/test_semantics.py)
XLA_PYTHON_CLIENT_PREALLOCATE=false part tests "${TEST_SECONDS:-150}" \
  python3 -m pytest -q -n "${WORKERS:-8}" -p no:cacheprovider -rfE \
  --junitxml="$OUT/junit.xml" "${tests[@]}"
grep -E '^(FAILED|ERROR)|passed|failed' "$OUT/tests.log" 2>/dev/null | cut -c1-160 | tail -60
