#!/usr/bin/env bash
# The GPU record in one device call, through the product's own commands: pack the synthetic 7B
# and 1.5B, benchmark the 7B (benchmark_e2e), run the whole validation ladder on both, time a
# CUDA-backed server for one client, and run the GPU tests. Logs land in $OUT; table last.
#
#   bash tools/h200_record.sh            (on an sm_90 machine, from the repository root)
#
# Wheels for the HTTP stack, when the machine lacks them, are installed from .whl/ if present.
set -uo pipefail
OUT=${OUT:-/tmp/nanoqwen-record}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-}
nq() { python3 -m nanoqwen.cli "$@"; }
declare -a ROWS
step() {  # step NAME COMMAND...: run, log to $OUT/NAME.log, remember status and seconds
    local name=$1 t0=$SECONDS
    shift
    "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    ROWS+=("$(printf '%-16s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
    echo "${ROWS[-1]}"
}

# Most important first: a call cut short at its time limit still returns what is in $OUT.
step pack-7b nq pack --synthetic 7b --no-progress -o /tmp/s7b.nanoqwen
step bench-7b nq bench /tmp/s7b.nanoqwen --json "$OUT/bench_7b.json"
step validate-7b nq validate /tmp/s7b.nanoqwen --tier all
step pack-1.5b nq pack --synthetic 1.5b --no-progress -o /tmp/s15.nanoqwen
step validate-1.5b nq validate /tmp/s15.nanoqwen --tier all

serve_once() {  # one client against a CUDA-backed server: TTFT of the stream and tokens/s
    nq serve /tmp/s7b.nanoqwen --backend cuda --port 8011 --log-level warning &
    local pid=$!
    for _ in $(seq 120); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" \
            2>/dev/null && break
        sleep 1
    done
    python3 tools/load_test.py --url http://127.0.0.1:8011 --concurrency 1 --requests 5 \
        --max-tokens 128 --endpoint chat
    local rc=$?
    kill "$pid"
    wait "$pid"
    return $rc
}
step serve-7b serve_once
step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests

for f in bench-7b validate-7b validate-1.5b serve-7b gpu-tests; do
    echo "==== $f"
    tail -n 40 "$OUT/$f.log"
done
echo "==== steps"
printf '%s\n' "${ROWS[@]}"
