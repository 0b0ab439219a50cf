#!/usr/bin/env bash
# `make test` and `make test-demos`, in two lanes where the machine has two or more cores:
#   scripts/run_tests.sh          the unit, integration, cluster, stress and real-model tiers (make test)
#   scripts/run_tests.sh demos    the learning demos (make test-demos)
# make test: the integration tier in the main lane. The side lane runs, one after the other: the unit tier pinned
# to the last core (~2.5 minutes; nothing in it needs a second), the cluster tier (Slurm jobs, rclone, shell
# scripts; ~3.5 minutes), the stress tier with the integration tier beside it as its load (RL_STRESS_BURNERS=0:
# tests/stress), the real-model tier (tests/real_model: SmolLM2-135M-Instruct, skipped without `make real-model`
# unless RL_REQUIRE_REAL_MODEL=1), then the integration tier's modules the main lane has not reached: those marked side_lane_first,
# then from the last (tests/lanes.py: each module runs once, in whichever lane takes it first). ~18 minutes in all
# on 2 cores.
# make test-demos: the demos marked one_core (reverse, code, reasoning-gym and the real model's short version, ~17
# minutes on one core) run on the last core while the search demo's SFT stages hold the first (one rank, one
# thread: its warm start depends on that arithmetic, docs/search.md); then the other demos, one after the other.
# The side lane has temporary directories of its own and its output comes after the main lane's; the exit status
# is the side lane's where it failed, else the main lane's. One core: everything in one lane, in order (the
# stress tier with its own busy loops).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-.venv/bin/python}
last_core=$("$PY" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[-1] if len(c) > 1 else "")')
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
pytest_in() {  # [PIN=1] pytest_in NAME ARGS...: a pytest with a temporary directory of its own (PIN: on the last core)
  local name=$1 pin=()
  shift
  [ -z "${PIN:-}" ] || pin=(taskset -c "$last_core")
  "${pin[@]}" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$work/$name" "$@"
}

if [ "${1:-}" = demos ]; then
  if [ -z "$last_core" ]; then
    exec "$PY" -m pytest -q --durations=0 tests/demos
  fi
  # One torch thread per process unless set (scripts/check_robustness.sh's cells set it): the side lane holds the
  # last core throughout, and a process of the main lane left at two threads spun at every op's barrier there (the
  # async demo's SFT took 246 s at 2 threads beside it, CI 2026-12-07; the whole reverse demo 164 s on one core).
  export RL_CPU_THREADS=${RL_CPU_THREADS:-1}
  main() { "$PY" -m pytest -q -m "not one_core" --durations=0 tests/demos; }  # search first: tests/demos/conftest.py
  side() { PIN=1 pytest_in side -m one_core --durations=0 tests/demos; }
else
  if [ -z "$last_core" ]; then
    "$PY" -m pytest -q --durations=30 tests/unit tests/integration tests/cluster tests/real_model || exit $?
    exec "$PY" -m pytest -q -p no:cacheprovider tests/stress
  fi
  export RL_TEST_CLAIMS="$work/claims"  # the integration tier's modules, shared by the lanes: tests/lanes.py
  # One torch thread per process (rl_training/runtime/seeding.py): with the other lane on a core, a second thread
  # spins at every op's barrier; a test of in-process runs took 67 s instead of 11 beside a two-thread load.
  export RL_CPU_THREADS=1
  mkdir "$RL_TEST_CLAIMS"
  main() { "$PY" -m pytest -q -p tests.lanes --durations=30 tests/integration; }
  side() {
    local status=0 rc
    for tier in unit cluster stress real integration; do
      case $tier in
        unit) PIN=1 pytest_in unit --durations=10 tests/unit ;;
        cluster) pytest_in cluster --durations=10 tests/cluster ;;
        stress) RL_STRESS_BURNERS=0 pytest_in stress -rA tests/stress ;;
        real) pytest_in real --durations=10 tests/real_model ;;
        integration) RL_TEST_LANE=side pytest_in integration -p tests.lanes --durations=10 tests/integration ;;
      esac
      rc=$?
      [ "$status" -ne 0 ] || status=$rc  # the first failure's; the tiers after it still run
    done
    return "$status"
  }
fi

t0=$SECONDS
side >"$work/side.log" 2>&1 &
side_pid=$!
main
main_status=$?
echo "== main lane: exit $main_status after $((SECONDS - t0)) s =="
wait "$side_pid"
side_status=$?
echo
echo "== side lane (ran alongside the main lane; its pinned runs on core $last_core): exit $side_status =="
cat "$work/side.log"
[ "$side_status" -eq 0 ] || exit "$side_status"
exit "$main_status"
