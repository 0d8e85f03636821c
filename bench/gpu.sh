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
[ "$DEVICE" = cpu ] && [ "$BUDGET" = 300 ] && BUDGET=600  # the CPU check: slower imports, every code path still runs
declare -A RC

# part NAME SECONDS COMMAND...: run it under the smaller of its limit and what is left of the budget (an argument
# @SECONDS@ becomes that limit less 10 s for the process's start: the part's sections box themselves in it); print
# every JSON line of its stdout, and a line saying how it failed when it did.
part() {
  local name=$1 limit=$2; shift 2
  local left=$((BUDGET - SECONDS - 5))
  if [ "$left" -lt 10 ]; then
    echo "{\"part\": \"$name\", \"skipped\": \"the ${BUDGET}s budget is spent\"}" | tee -a "$RESULTS"; RC[$name]=skipped; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$SECONDS args=()
  for a in "$@"; do [ "$a" = @SECONDS@ ] && args+=("$((limit - 10))") || args+=("$a"); done
  timeout --kill-after=10 "$limit" "${args[@]}" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local rc=$?
  RC[$name]=$rc
  local lines
  lines=$(grep '^{' "$LOGS/$name.out")
  [ -n "$lines" ] && echo "$lines" | tee -a "$RESULTS"
  if [ "$rc" -ne 0 ] || [ -z "$lines" ]; then
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

# The most important measurements first (docs/GPU_CHECKS.md): what the budget cannot reach prints a skip line.
MODEL=$WORK/model MODEL8=$WORK/model-8b
SECTIONS=("$PY" bench/gpu_sections.py --device "$DEVICE" --data-dir "$WORK/data" --seconds @SECONDS@ $TINY "${THREADS[@]}")
part install 40 bash -c install_wheels
part env 30 "$PY" bench/gpu_bench.py env
part model 60 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODEL" --device "$DEVICE" $TINY
part train_1b 90 "${SECTIONS[@]}" train_1b --model "$MODEL"
part decode_1b 60 "${SECTIONS[@]}" decode_1b --model "$MODEL"
part kernels 25 "${SECTIONS[@]}" kernels
part cuda_tests 60 bash -c cuda_tests
rm -rf "$MODEL"  # the 8B shape's 15 GB need the disk more
part model_8b 45 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODEL8" --device "$DEVICE" --shape 8b $TINY
part eight_b 75 "${SECTIONS[@]}" eight_b --model "$MODEL8"

summary=""
for name in install env model train_1b decode_1b kernels cuda_tests model_8b eight_b; do summary+="\"$name\": \"${RC[$name]:-none}\", "; done
echo "{\"gpu_sh\": \"done\", \"device\": \"$DEVICE\", \"seconds\": $SECONDS, \"exit_codes\": {${summary%, }}}" | tee -a "$RESULTS"
if [ -n "${OUT:-}" ]; then
  cp "$RESULTS" "$OUT/gpu-results.jsonl"
  tar -czf "$OUT/gpu-logs.tar.gz" -C "$WORK" logs cuda-tests.xml 2>/dev/null || tar -czf "$OUT/gpu-logs.tar.gz" -C "$WORK" logs
fi
