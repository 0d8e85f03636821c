#!/usr/bin/env bash
# Signal's device checks in one go, on a bare GPU machine: the CUDA tests, then the GPU benchmarks.
#
#   bench/gpu.sh                      # on the GPU machine (docs/GPU_CHECKS.md: how to carry it there)
#   bench/gpu.sh --device cpu --tiny  # here, on CPU with the tiny model: every code path but CUDA's
#
# Needs build/gpu-assets (make gpu-prepare, on a machine with the project installed). Uses the machine's own
# python3 (PYTHON=...), torch and transformers; installs the carried wheels it lacks into $WORK/site. Each part
# runs under `timeout`, within a 5-minute budget for the whole script (--budget S), and prints its JSON line as
# it finishes; a part that fails or times out prints one saying so, with the end of its stderr. Logs go to
# $WORK/logs; where $OUT is set (the device tool's folder that comes back) the JSON lines and a tarball of the
# logs are copied there.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda TINY="" BUDGET=300 ASSETS=build/gpu-assets
WORK=${WORK:-/tmp/signal-gpu}
PY=${PYTHON:-python3}
while [ $# -gt 0 ]; do
  case "$1" in
    --device) DEVICE=$2; shift 2 ;;
    --tiny) TINY=--tiny; shift ;;
    --budget) BUDGET=$2; shift 2 ;;
    --assets) ASSETS=$2; shift 2 ;;
    *) echo "usage: bench/gpu.sh [--device cuda|cpu] [--tiny] [--budget SECONDS] [--assets DIR]" >&2; exit 2 ;;
  esac
done
[ -f "$ASSETS/manifest.json" ] || { echo "no $ASSETS/manifest.json: run make gpu-prepare first" >&2; exit 2; }

LOGS=$WORK/logs RESULTS=$WORK/results.jsonl
rm -rf "$WORK" && mkdir -p "$LOGS"
# No network there: never let transformers or the Hub try; keep the tokenizer threads out of the timings.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export SIGNAL_GPU_ASSETS=$PWD/$ASSETS
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
THREADS=() ; [ "$DEVICE" = cpu ] && THREADS=(--threads 1)  # a shared CPU: one thread steadies the figures
declare -A RC

# part NAME SECONDS COMMAND...: run it under the smaller of its limit and what is left of the budget; print the last
# JSON line of its stdout, or a line saying how it failed.
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 10 ]; then
    echo "{\"part\": \"$name\", \"skipped\": \"the ${BUDGET}s budget is spent\"}" | tee -a "$RESULTS"; RC[$name]=skipped; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$SECONDS
  timeout --kill-after=10 "$limit" "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local rc=$?
  RC[$name]=$rc
  local line
  line=$(grep '^{' "$LOGS/$name.out" | tail -n 1)
  if [ "$rc" -eq 0 ] && [ -n "$line" ]; then
    echo "$line" | tee -a "$RESULTS"
  else
    "$PY" - "$name" "$rc" "$limit" "$((SECONDS - started))" "$LOGS/$name.err" <<'EOF' | tee -a "$RESULTS"
import json, sys
name, rc, limit, took, err = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
tail = open(err, errors="replace").read()[-1500:]
print(json.dumps({"part": name, "rc": rc, "timed_out": rc in (124, 137), "limit_s": limit, "seconds": took,
                  "stderr_tail": tail}))
EOF
  fi
}

# The parts that are several commands: functions, exported so that `timeout` can run them through bash.
install_wheels() {
  local wheels
  wheels=$("$PY" bench/gpu_bench.py wheels --assets "$ASSETS") || return 1
  if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086 # one path per line, none with spaces
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" $wheels || return 1
  fi
  echo "{\"part\": \"install\", \"installed\": \"$(echo $wheels | xargs -n1 -r basename | tr '\n' ' ')\"}"
}

cuda_tests() {
  "$PY" -m pytest tests/cuda -v -rfEs -p no:cacheprovider -W default --junitxml "$WORK/cuda-tests.xml" >&2
  "$PY" bench/gpu_bench.py junit "$WORK/cuda-tests.xml" --pytest-rc $?
}
export -f install_wheels cuda_tests
export PY ASSETS WORK

MODEL=$WORK/model
part install 60 bash -c install_wheels
part env 30 "$PY" bench/gpu_bench.py env
part cuda_tests 110 bash -c cuda_tests
part model 60 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODEL" --device "$DEVICE" $TINY
part cobatch 60 "$PY" bench/cobatch.py --model "$MODEL" --device "$DEVICE" --data-dir "$WORK/data" --quick --profile "${THREADS[@]}"
part mfu 50 "$PY" bench/gpu_bench.py mfu --model "$MODEL" --device "$DEVICE" --data-dir "$WORK/data" $TINY "${THREADS[@]}"
if [ -n "$TINY" ]; then SIZE=(--quick); else SIZE=(--steps 4 --batch-size 8 --seq-len 1024); fi
part engine_throughput 80 "$PY" bench/engine_throughput.py --model "$MODEL" --device "$DEVICE" --data-dir "$WORK/data" "${SIZE[@]}" "${THREADS[@]}"

summary=""
for name in install env cuda_tests model cobatch mfu engine_throughput; do summary+="\"$name\": \"${RC[$name]:-none}\", "; done
echo "{\"gpu_sh\": \"done\", \"device\": \"$DEVICE\", \"seconds\": $SECONDS, \"exit_codes\": {${summary%, }}}" | tee -a "$RESULTS"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS" "$OUT/gpu-results.jsonl"
  tar -czf "$OUT/gpu-logs.tar.gz" -C "$WORK" logs cuda-tests.xml 2>/dev/null || tar -czf "$OUT/gpu-logs.tar.gz" -C "$WORK" logs
fi
