#!/bin/sh
# serve_soak.sh - runs test_serve many times under CPU load and counts passes
# (make serve-soak; not part of CI: it takes minutes and loads the machine).
#
# Usage: serve_soak.sh BUILD_DIR [RUNS] [COPIES] [BUSY]
#   RUNS    test_serve runs in all (default 50)
#   COPIES  runs started side by side, so their servers compete (default 2)
#   BUSY    busy-loop processes kept running during the soak (default 1)
# TEST_SERVE_FILTER (cmocka pattern) picks a subset, e.g. 'test_recurrent*'.
#
# Each run has its own timeout (SOAK_TIMEOUT seconds, default 600): a hang is
# counted as a failure and its output kept. The servers a run spawned die
# with it (PR_SET_PDEATHSIG in tests/http_client.c). The last line is
# "serve soak: P of N runs passed"; the exit status is 0 only when P == N.
set -u
build=${1:?usage: serve_soak.sh BUILD_DIR [RUNS] [COPIES] [BUSY]}
runs=${2:-50}
copies=${3:-2}
busy=${4:-1}
timeout_s=${SOAK_TIMEOUT:-600}
build=$(cd "$build" && pwd) || exit 2
fixtures=${EMBER_FIXTURES:-$(cd "$build/.." && pwd)/../shared/fixtures}
logs=$build/soak
rm -rf "$logs"
mkdir -p "$logs"

busy_pids=""
stop_busy() {
    for p in $busy_pids; do kill "$p" 2>/dev/null; done
    busy_pids=""
}
trap 'stop_busy' EXIT
trap 'stop_busy; exit 130' INT TERM
i=0
while [ "$i" -lt "$busy" ]; do
    sh -c 'while :; do :; done' &
    busy_pids="$busy_pids $!"
    i=$((i + 1))
done

passed=0
done_runs=0
t0=$(date +%s)
while [ "$done_runs" -lt "$runs" ]; do
    batch=""
    k=0
    while [ "$k" -lt "$copies" ] && [ "$done_runs" -lt "$runs" ]; do
        done_runs=$((done_runs + 1))
        out=$logs/run-$done_runs.log
        EMBER_FIXTURES=$fixtures EMBER_BIN=$build/ember EMBER_BUILD_DIR=$build \
            timeout -s KILL "$timeout_s" "$build/test_serve" >"$out" 2>&1 &
        batch="$batch $done_runs:$!"
        k=$((k + 1))
    done
    for entry in $batch; do
        n=${entry%%:*}
        pid=${entry#*:}
        wait "$pid"
        rc=$?
        if [ "$rc" -eq 0 ]; then
            passed=$((passed + 1))
            rm -f "$logs/run-$n.log"
        else
            echo "run $n: exit $rc$( [ "$rc" -eq 137 ] && echo ' (timed out: a hang)'); output kept in $logs/run-$n.log"
        fi
    done
done
stop_busy
echo "serve soak: $passed of $runs runs passed ($copies side by side, $busy busy loop(s), filter '${TEST_SERVE_FILTER:-all}', $(( $(date +%s) - t0 )) s)"
[ "$passed" -eq "$runs" ]
