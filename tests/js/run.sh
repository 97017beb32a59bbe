#!/bin/sh
# run.sh - CTest entry for the npm client test: installs the pinned `openai`
# package with `npm ci` into a scratch copy of this directory, starts
# `ember serve` on a tiny generated model (port 0), runs client_test.mjs.
# Exit 77 (CTest: skipped) when node/npm or the npm registry is unavailable.
# usage: run.sh EMBER_BIN SOURCE_DIR WORK_DIR
set -u
bin="$1"; src="$2"; work="$3"
command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1 || { echo "skipping: node/npm not installed"; exit 77; }
rm -rf "$work"; mkdir -p "$work"
cp "$src/package.json" "$src/package-lock.json" "$src/client_test.mjs" "$work/"
cd "$work"
if ! timeout 300 npm ci --no-audit --no-fund >npm.log 2>&1; then
    echo "skipping: npm ci failed (registry unavailable?)"; tail -5 npm.log; exit 77
fi
"$bin" mkmodel --arch qwen3 --preset tiny --seed 5 --out tiny.gguf >/dev/null 2>&1 || { echo "mkmodel failed"; exit 1; }
"$bin" serve tiny.gguf --port 0 --threads 2 --no-disk --api-key js-key 2>server.log &
pid=$!
port=""
for i in $(seq 1 200); do
    port=$(sed -n 's/.*listening on http:\/\/127\.0\.0\.1:\([0-9]*\).*/\1/p' server.log | head -1)
    [ -n "$port" ] && break
    kill -0 $pid 2>/dev/null || break
    sleep 0.05
done
if [ -z "$port" ]; then echo "server did not start"; cat server.log; kill $pid 2>/dev/null; exit 1; fi
EMBER_URL="http://127.0.0.1:$port/v1" EMBER_API_KEY=js-key timeout 120 node client_test.mjs
rc=$?
kill -TERM $pid
wait $pid
src_rc=$?
[ $rc -ne 0 ] && cat server.log
[ $src_rc -ne 0 ] && { echo "server exited with $src_rc"; cat server.log; exit 1; }
exit $rc
