#!/usr/bin/env bash
# The replica-layer tests N times with a CPU-bound process on every core beside them, as on a
# busy CI machine; prints each run's result and the pass count, keeps each run's log.
#
#   scripts/stress_ft.sh [N] [pytest args...]     (default: 10 runs of tests/dist/test_ft.py,
#                                                  test_ft_votes.py and test_group_check.py: 6-10 min a run on
#                                                  2 cores, an hour or more for the 10)
#
# Exits 0 only if every run passed. Logs: runs/stress_ft/run<i>.log.
set -u
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
runs="${1:-10}"
shift $(( $# > 0 ? 1 : 0 ))
tests=("$@")
[ ${#tests[@]} -gt 0 ] || tests=(tests/dist/test_ft.py tests/dist/test_ft_votes.py tests/dist/test_group_check.py)
python="$root/.venv/bin/python"
[ -x "$python" ] || { echo "stress_ft: no .venv here; run scripts/setup.sh first" >&2; exit 2; }
logs="$root/runs/stress_ft"
mkdir -p "$logs"

hogs=()
test_pid=""
stop() {
  [ -n "$test_pid" ] && pkill -TERM -P "$test_pid" 2>/dev/null && kill "$test_pid" 2>/dev/null
  [ ${#hogs[@]} -gt 0 ] && kill "${hogs[@]}" 2>/dev/null
  wait 2>/dev/null
}
trap stop EXIT
trap 'echo "stress_ft: interrupted"; exit 130' INT TERM
cores=$(nproc)
for _ in $(seq "$cores"); do
  "$python" -c "while True: pass" &
  hogs+=($!)
done
echo "stress_ft: $runs run(s) of ${tests[*]} beside $cores CPU-bound process(es) (the replica-layer files: 6-10 min a run on 2 cores)"

passed=0
for i in $(seq "$runs"); do
  start=$(date +%s)
  "$python" -m pytest -q -p no:cacheprovider "${tests[@]}" > "$logs/run$i.log" 2>&1 &
  test_pid=$!
  if wait "$test_pid"; then
    passed=$((passed + 1)); result=passed
  else
    result="FAILED (see $logs/run$i.log)"
  fi
  echo "run $i/$runs: $result in $(( $(date +%s) - start )) s; $(grep -E '[0-9]+ (passed|failed)' "$logs/run$i.log" | tail -n 1)"
done
echo "stress_ft: $passed of $runs runs passed"
[ "$passed" -eq "$runs" ]
