#!/usr/bin/env bash
# `make test` and `make test-demos`, in two lanes where the machine has two or more cores:
#   scripts/run_tests.sh          the unit, integration and cluster tiers (make test)
#   scripts/run_tests.sh demos    the learning demos (make test-demos)
# make test: the unit tier (~2.5 minutes on one core; nothing in it needs a second) runs on the last core
# alongside the integration and cluster tiers, which take every core only in their multi-rank runs (on average
# the suite kept one of two cores busy: its user time was its wall time).
# make test-demos: the demos marked one_core (reverse and code, ~5 minutes on one core) run on the last core while
# the search demo's SFT stages hold the first (one rank, one thread: its warm start depends on that arithmetic,
# docs/search.md); then the other demos, one after the other.
# The side lane has a temporary directory of its own and its output comes after the main lane's; the exit status
# is the side lane's where it failed, else the main lane's. One core: everything in one pytest, in order.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PY=${PY:-.venv/bin/python}

if [ "${1:-}" = demos ]; then
  side=(-m one_core --durations=0 tests/demos)
  main=(-m "not one_core" --durations=0 tests/demos)  # the search demo first (leaves_a_core: tests/demos/conftest.py)
  all=(--durations=0 tests/demos)
else
  side=(--durations=10 tests/unit)
  main=(--durations=30 tests/integration tests/cluster)
  all=(--durations=30 tests/unit tests/integration tests/cluster)
fi

last_core=$("$PY" -c 'import os; c = sorted(os.sched_getaffinity(0)); print(c[-1] if len(c) > 1 else "")')
if [ -z "$last_core" ]; then
  exec "$PY" -m pytest -q "${all[@]}"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
taskset -c "$last_core" "$PY" -m pytest -q -p no:cacheprovider --basetemp="$work/tmp" "${side[@]}" \
  >"$work/side.log" 2>&1 &
side_pid=$!
"$PY" -m pytest -q "${main[@]}"
main_status=$?
wait "$side_pid"
side_status=$?
echo
echo "== ${side[*]}: ran alongside on core $last_core, exit $side_status =="
cat "$work/side.log"
[ "$side_status" -eq 0 ] || exit "$side_status"
exit "$main_status"
