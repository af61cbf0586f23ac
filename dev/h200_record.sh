#!/usr/bin/env bash
# The GPU record through the product's own commands, in two parts that each fit one device
# call (10 minutes). The logs end up in $OUT/logs.tgz; a status table comes last.
#
#   bash dev/h200_record.sh bench      pack the synthetic 7B; bench it at prompt 512 (with
#                                      --kernels, --plot, --baseline transformers), 8192 and
#                                      32704 (+64); the whole validation ladder on the 7B
#   bash dev/h200_record.sh rest       the ladder on the synthetic 1.5B, a CUDA-backed server
#                                      timed for one client (dev/load_test.py), where the
#                                      7B's TTFT goes (dev/ttft_profile.py), the GPU tests
#   bash dev/h200_record.sh family M.. for each preset M (3b, 14b, 32b): its synthetic pack
#                                      benched at prompt 512 and 8192, the unit tier on it,
#                                      the whole ladder at its widths and 8 layers (the
#                                      32B's float32 reference takes 131 GB at 64 layers);
#                                      packing takes ~30 s (3B) to ~4 minutes (32B): one
#                                      preset a call
#   bash dev/h200_record.sh batching   continuous batching on the synthetic 7B: dev/batch_check.py
#                                      (every part), bench --concurrency 1,2,4,8,16 (prompt
#                                      512, 128 tokens), a server under dev/load_test.py at the
#                                      same levels with one shared and with distinct prompts,
#                                      dev/server_overhead.py (the host's cost per token over a
#                                      stand-in engine of the 7B's step time, N = 1..16)
#   bash dev/h200_record.sh speculation FILE
#                                      on a real pack (dev/stage_real.py puts the 1.5B at
#                                      /tmp/real/1.5b.nanoqwen): the drafting backoff's caps
#                                      0, 16:1, 16:0 on the three workloads, greedy (with the
#                                      float32 margin where a reply parts) and sampled
#                                      (dev/spec_workloads.py), bench --concurrency 1,2,4,8,16
#
# The bench results keep stable names, overwritten by every run, in $OUT/results/:
# h200_7b_synthetic_{512,8k,32k}.json and h200_7b_synthetic_itl_{512,32k}.png. They are
# copied into benchmarks/results/ as they are; git keeps their history.
#
# The synthetic packs are seeded (identical bytes every time), so a pack already under /tmp
# is reused. Wheels for the HTTP stack, when the machine lacks them, are installed from .whl/.
set -uo pipefail
PART=${1:?usage: h200_record.sh bench|rest|family PRESET...}
OUT=${OUT:-/tmp/nanoqwen-record}
RESULTS=$OUT/results LOGS=$OUT/logs
mkdir -p "$RESULTS" "$LOGS"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=.:${PYTHONPATH:-}
nq() { python3 -m nanoqwen.cli "$@"; }
declare -a ROWS
step() {  # step NAME COMMAND...: run, log to $LOGS/NAME.log, remember status and seconds
    local name=$1 t0=$SECONDS
    shift
    "$@" >"$LOGS/$name.log" 2>&1
    local rc=$?
    ROWS+=("$(printf '%-16s rc=%-3s %4ss' "$name" "$rc" $((SECONDS - t0)))")
    echo "${ROWS[-1]}"
}
pack() {  # pack PRESET PATH [ARGS] (skipped when PATH exists: the synthetic packs are
    # deterministic)
    [ -f "$2" ] || step "pack-$(basename "$2" .nanoqwen)" nq pack --synthetic "$1" --no-progress \
        -o "$2" "${@:3}"
}
report() {  # the tails of the named logs, the status table; the logs into one archive
    for f in "$@"; do
        echo "==== $f"
        tail -n 40 "$LOGS/$f.log"
    done
    echo "==== steps"
    printf '%s\n' "${ROWS[@]}"
    tar -czf "$OUT/logs.tgz" -C "$OUT" logs && rm -r "$LOGS"
}

load_levels() {  # load_levels NAME [ARGS]: a CUDA-backed server on the 7B under dev/load_test.py
    # at N = 1..16, 64 requests of a 512-token prompt (token ids: a text's count depends on the
    # tokenizer, and the synthetic pack's is byte-level) and 128 tokens; JSON and plot by NAME
    nq serve /tmp/s7b.nanoqwen --backend cuda --port 8012 --log-level warning &
    local pid=$! name=$1
    shift
    for _ in $(seq 120); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8012/health')" \
            2>/dev/null && break
        sleep 1
    done
    python3 dev/load_test.py --url http://127.0.0.1:8012 --endpoint completions \
        --concurrency 1,2,4,8,16 --requests 64 --max-tokens 128 --prompt-tokens 512 \
        --out "$RESULTS/$name.json" --plot "$RESULTS/$name.png" "$@"
    local rc=$?
    kill "$pid"
    wait "$pid"
    return $rc
}

serve_once() {  # one client against a CUDA-backed server: TTFT of the stream and tokens/s
    nq serve /tmp/s7b.nanoqwen --backend cuda --port 8011 --log-level warning &
    local pid=$!
    for _ in $(seq 120); do
        python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8011/health')" \
            2>/dev/null && break
        sleep 1
    done
    python3 dev/load_test.py --url http://127.0.0.1:8011 --concurrency 1 --requests 5 \
        --max-tokens 128 --endpoint chat
    local rc=$?
    kill "$pid"
    wait "$pid"
    return $rc
}

# Most important first: a call cut short at its time limit still returns what is in $OUT.
if [ "$PART" = bench ]; then
    pack 7b /tmp/s7b.nanoqwen
    step bench-512 nq bench /tmp/s7b.nanoqwen --kernels \
        --plot "$RESULTS/h200_7b_synthetic_itl_512.png" --baseline transformers \
        --json "$RESULTS/h200_7b_synthetic_512.json"
    step bench-8k nq bench /tmp/s7b.nanoqwen --prompt-len 8192 --warmup 1 --runs 5 --kernels \
        --json "$RESULTS/h200_7b_synthetic_8k.json"
    step bench-32k nq bench /tmp/s7b.nanoqwen --prompt-len 32704 --gen-len 64 --warmup 1 \
        --runs 3 --kernels --plot "$RESULTS/h200_7b_synthetic_itl_32k.png" \
        --json "$RESULTS/h200_7b_synthetic_32k.json"
    step validate-7b nq validate /tmp/s7b.nanoqwen --tier all
    report bench-512 bench-8k bench-32k validate-7b
elif [ "$PART" = batching ]; then
    pack 7b /tmp/s7b.nanoqwen
    step batch-check python3 dev/batch_check.py /tmp/s7b.nanoqwen --out "$RESULTS"
    step concurrency nq bench /tmp/s7b.nanoqwen --concurrency 1,2,4,8,16 --prompt-len 512 \
        --gen-len 128 --json "$RESULTS/h200_7b_synthetic_concurrency.json" \
        --plot "$RESULTS/h200_7b_synthetic_concurrency.png"
    step load-shared load_levels h200_7b_synthetic_load_shared
    step load-distinct load_levels h200_7b_synthetic_load_distinct --distinct
    pack tiny /tmp/tiny.nanoqwen
    step server-overhead python3 dev/server_overhead.py /tmp/tiny.nanoqwen --step-ms 2.9 --gil-check \
        --json "$RESULTS/h200_server_overhead.json"
    report batch-check concurrency load-shared load-distinct server-overhead
elif [ "$PART" = speculation ]; then
    FILE=${2:?usage: h200_record.sh speculation FILE}
    m=$(basename "$FILE" .nanoqwen)
    step spec-greedy python3 dev/spec_workloads.py "$FILE" --runs 3 --spec-backoff 0,16:1,16:0 --margins \
        --json "$RESULTS/h200_${m}_real_speculative_backoff.json"
    step spec-sampled python3 dev/spec_workloads.py "$FILE" --runs 3 \
        --spec-backoff 0,16:1,16:0 --sampled \
        --json "$RESULTS/h200_${m}_real_speculative_backoff_sampled.json"
    step concurrency nq bench "$FILE" --concurrency 1,2,4,8,16 --prompt-len 512 \
        --gen-len 128 --json "$RESULTS/h200_${m}_real_concurrency.json" \
        --plot "$RESULTS/h200_${m}_real_concurrency.png"
    report spec-greedy spec-sampled concurrency
elif [ "$PART" = family ]; then
    shift
    names=()
    for m in "$@"; do
        pack "$m" "/tmp/s$m.nanoqwen"
        step "bench-$m-512" nq bench "/tmp/s$m.nanoqwen" --kernels \
            --json "$RESULTS/h200_${m}_synthetic_512.json"
        step "bench-$m-8k" nq bench "/tmp/s$m.nanoqwen" --prompt-len 8192 --warmup 1 --runs 5 \
            --json "$RESULTS/h200_${m}_synthetic_8k.json"
        step "unit-$m" nq validate "/tmp/s$m.nanoqwen" --tier unit
        pack "$m" "/tmp/s$m-8l.nanoqwen" --layers 8
        step "validate-$m-8l" nq validate "/tmp/s$m-8l.nanoqwen" --tier all
        names+=("bench-$m-512" "bench-$m-8k" "unit-$m" "validate-$m-8l")
    done
    report "${names[@]}"
else
    pack 1.5b /tmp/s15.nanoqwen
    step validate-1.5b nq validate /tmp/s15.nanoqwen --tier all
    pack 7b /tmp/s7b.nanoqwen
    step serve-7b serve_once
    step ttft-7b python3 dev/ttft_profile.py /tmp/s7b.nanoqwen
    step gpu-tests python3 -m pytest -q -p no:cacheprovider -m gpu tests
    report validate-1.5b serve-7b ttft-7b gpu-tests
fi
