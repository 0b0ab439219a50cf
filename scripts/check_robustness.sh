#!/usr/bin/env bash
# Do the learning results hold on any CPU (issue 49, item 4)? Runs the demos tier and the learning tests under a
# matrix of CPU kernels x torch threads x data orders and prints every learning margin against its bar, per cell.
#
#   scripts/check_robustness.sh                      # the whole matrix: 2 x 2 x 2 cells, ~20 minutes each on 2 cores
#   scripts/check_robustness.sh default,1,100 avx2,2,200 ...   # chosen cells: KERNELS,THREADS,ORDER
#   DEMOS=0 TESTS=tests/integration/test_tool_env.py scripts/check_robustness.sh ...   # the tests only, or others
# A cell runs the demos tier as `make test-demos` does (scripts/run_tests.sh demos: two lanes on two cores), then
# the learning tests of $TESTS (default: the tool environment's gated warm start and the SFT gate's own tests).
#
# The axes:
# - kernels: `default` (what torch picks for this CPU: AVX-512 where it has it) or `avx2` (ATEN_CPU_CAPABILITY=avx2
#   for PyTorch's own kernels, MKL_ENABLE_INSTRUCTIONS=AVX2 and ONEDNN_MAX_CPU_ISA=AVX2 for the libraries': all
#   three, or some kernels keep AVX-512 and the arithmetic is neither machine's);
# - threads: RL_CPU_THREADS, the torch threads of every process that honours it (rl_training/runtime/seeding.py);
# - order: RL_DATA_ORDER, added to every data order (train.seed) a demo sets (scripts/demo.py data_order): 100 and
#   200 are orders no demo was developed with.
# Each test records its margins (tests/helpers.py clears) in $RL_MARGINS; a cell passes when its tests pass. The
# table (scripts/ci_summary.py) goes to stdout and, with every margin, to $OUT/robustness.json (OUT: default
# runs/robustness_<time>).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/robustness_$(date +%Y%m%d_%H%M%S)}
DEMOS=${DEMOS:-1}
TESTS=${TESTS:-"tests/integration/test_tool_env.py tests/integration/test_sft_gate.py"}
mkdir -p "$OUT"

cells=("$@")
if [ ${#cells[@]} -eq 0 ]; then
  for kernels in default avx2; do
    for threads in 1 2; do
      for order in 100 200; do cells+=("$kernels,$threads,$order"); done
    done
  done
fi

status=0
for cell in "${cells[@]}"; do
  IFS=, read -r kernels threads order <<<"$cell"
  case $kernels in
    default) isa=() ;;
    avx2) isa=(ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2) ;;
    *) echo "check_robustness: kernels must be default or avx2, got '$kernels' in cell '$cell'" >&2; exit 2 ;;
  esac
  [[ $threads =~ ^[1-9][0-9]*$ && $order =~ ^[0-9]+$ ]] || {
    echo "check_robustness: a cell is KERNELS,THREADS,ORDER (e.g. avx2,1,100), got '$cell'" >&2
    exit 2
  }
  name="${kernels}_t${threads}_o${order}"
  rm -f "$OUT/$name.margins.jsonl"
  echo "== cell $name: ${isa[*]:-default kernels} RL_CPU_THREADS=$threads RL_DATA_ORDER=$order ==" | tee "$OUT/$name.log"
  t0=$SECONDS
  cell_env=("${isa[@]}" RL_CPU_THREADS="$threads" RL_DATA_ORDER="$order" RL_MARGINS="$OUT/$name.margins.jsonl")
  rc=0
  if [ "$DEMOS" = 1 ]; then
    env "${cell_env[@]}" scripts/run_tests.sh demos >>"$OUT/$name.log" 2>&1 || rc=$?
  fi
  if [ -n "$TESTS" ]; then
    # shellcheck disable=SC2086  # TESTS is a list of paths
    env "${cell_env[@]}" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$OUT/$name.tmp" $TESTS \
      >>"$OUT/$name.log" 2>&1 || rc=$((rc ? rc : $?))
    rm -rf "$OUT/$name.tmp"
  fi
  echo "{\"cell\": \"$name\", \"exit\": $rc, \"seconds\": $((SECONDS - t0))}" >"$OUT/$name.cell.json"
  tail -3 "$OUT/$name.log"
  [ "$rc" -eq 0 ] || status=1
done

"$PY" scripts/ci_summary.py --cells "$OUT"
exit "$status"
