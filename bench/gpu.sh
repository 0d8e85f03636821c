#!/usr/bin/env bash
# Signal's device checks in one go, on a bare GPU machine: the GPU benchmarks and the CUDA tests, most important first.
#
#   bench/gpu.sh                      # on the GPU machine (docs/GPU_CHECKS.md: how to carry it there)
#   bench/gpu.sh --device cpu --tiny  # here, on CPU with the tiny model: every code path but CUDA's
#
# Needs build/gpu-assets (make gpu-prepare, on a machine with the project installed); without it every part still
# prints its line, most of them an error saying so. Uses the machine's own python3 (PYTHON=...), torch and
# transformers; installs the carried wheels it lacks into $WORK/site (pip from the carried files only, or unzipped
# where there is no pip): nothing is fetched. Every part runs under `timeout` and ends by a global deadline
# (--budget, 290 s from the start); the measuring parts get that deadline and box their sections in it. Each part
# prints its JSON lines as it finishes; one that fails or is cut prints a line saying so, with the end of its
# stderr, and the script goes on. Logs go to $WORK/logs; where $OUT is set (the device tool's folder that comes
# back) the JSON lines are written there as they come, and a tarball of the logs at the end.
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda TINY="" BUDGET=290 ASSETS=build/gpu-assets
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
DEADLINE=$(($(date +%s) + BUDGET))
GRACE=12  # past a part's end before `timeout` cuts it: a section's own watchdog (gpu_box.GRACE_S, 10 s) goes first

LOGS=$WORK/logs RESULTS=$WORK/results.jsonl
rm -rf "$WORK" /dev/shm/signal-gpu-model-8b && mkdir -p "$LOGS" "$WORK/site"  # a warm machine keeps a last run's
[ -n "${OUT:-}" ] && RESULTS=$OUT/gpu-results.jsonl  # written as it goes: a cut call still brings the lines back
: >"$RESULTS"
# No network there: never let transformers or the Hub try; keep the tokenizer threads out of the timings.
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
export SIGNAL_GPU_ASSETS=$PWD/$ASSETS
export PYTHONPATH=$WORK/site:$PWD${PYTHONPATH:+:$PYTHONPATH}
THREADS=() ; [ "$DEVICE" = cpu ] && THREADS=(--threads 1)  # a shared CPU: one thread steadies the figures
declare -A RC PART_S
PARTS=()

# A JSON string of a file's last bytes, printable ASCII only (a cut may split a UTF-8 character; tqdm's bars are
# not worth keeping), without Python: the failure line must come out when the interpreter itself is what failed.
json_tail() {
  local s
  s=$(tail -c 1500 "$1" 2>/dev/null | tr -cd '\11\12\40-\176')
  s=${s//\\/\\\\}; s=${s//\"/\\\"}; s=${s//$'\t'/\\t}; s=${s//$'\n'/\\n}
  printf '"%s"' "$s"
}

emit() { echo "$1" | tee -a "$RESULTS"; }

# part NAME SECONDS COMMAND...: run it until the earlier of SECONDS from now and the deadline (an argument @END@
# becomes that end as epoch seconds: the part's sections box themselves in it); `timeout` cuts it GRACE later.
# Print every JSON line of its stdout, and a line saying how it failed when it did.
part() {
  local name=$1 limit=$2; shift 2
  PARTS+=("$name")
  local left=$((DEADLINE - $(date +%s)))
  if [ "$left" -lt 8 ]; then
    emit "{\"part\": \"$name\", \"skipped\": \"the ${BUDGET} s budget is spent\"}"; RC[$name]=skipped; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  local started=$SECONDS args=() end=$(($(date +%s) + limit))
  for a in "$@"; do [ "$a" = @END@ ] && args+=("$end") || args+=("$a"); done
  local cut=$((limit + GRACE)) hard=$((DEADLINE + 8 - $(date +%s)))  # never past the budget's end by more than 8 s
  [ "$cut" -gt "$hard" ] && cut=$hard
  timeout --kill-after=2 "$cut" "${args[@]}" >"$LOGS/$name.out" 2>"$LOGS/$name.err"
  local rc=$?
  RC[$name]=$rc PART_S[$name]=$((SECONDS - started))
  local lines
  lines=$(grep '^{' "$LOGS/$name.out")
  [ -n "$lines" ] && emit "$lines"
  if [ "$rc" -ne 0 ] || [ -z "$lines" ]; then
    emit "{\"part\": \"$name\", \"rc\": $rc, \"timed_out\": $([ "$rc" = 124 ] || [ "$rc" = 137 ] && echo true || echo false), \"limit_s\": $limit, \"seconds\": $((SECONDS - started)), \"stderr_tail\": $(json_tail "$LOGS/$name.err")}"
  fi
}

# The parts that are several commands: functions, exported so that `timeout` can run them through bash.
install_wheels() {
  [ -f "$ASSETS/manifest.json" ] || { echo "no $ASSETS/manifest.json: run make gpu-prepare and carry $ASSETS" >&2; return 2; }
  local wheels wheel
  wheels=$("$PY" bench/gpu_bench.py wheels --assets "$ASSETS") || return 1
  if [ -n "$wheels" ]; then
    if "$PY" -m pip --version >/dev/null 2>&1; then
      # shellcheck disable=SC2086 # one path per line, none with spaces
      "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" $wheels || return 1
    else  # no pip: a wheel is a zip of what goes on the path (the tests run as `python -m pytest`, no scripts needed)
      for wheel in $wheels; do "$PY" -m zipfile -e "$wheel" "$WORK/site" || return 1; done
    fi
  fi
  echo "{\"part\": \"install\", \"installed\": \"$(echo $wheels | xargs -n1 -r basename | tr '\n' ' ')\"}"
}

# pytest_part NAME ARGS...: the CUDA tests named, summarised from their junit report (one JSON line).
pytest_part() {
  local name=$1; shift
  if [ "$DEVICE" != cuda ]; then  # every test there skips without CUDA; the suite here collects them already
    echo "{\"part\": \"$name\", \"skipped\": \"--device $DEVICE: tests/cuda skip without CUDA\"}"; return 0
  fi
  "$PY" -m pytest "$@" -v -rfEs -p no:cacheprovider -W default --junitxml "$WORK/$name.xml" >&2
  "$PY" bench/gpu_bench.py junit "$WORK/$name.xml" --part "$name" --pytest-rc $?
}
export -f install_wheels pytest_part
export PY ASSETS WORK DEVICE

MODEL=$WORK/model MODEL8=$WORK/model-8b MODELMOE=$WORK/model-moe
# The 8B shape's 15 GB: in memory where /dev/shm has room (written and read back faster than a disk), else on disk.
SHM=$(df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 {print $4}')
[ -z "$TINY" ] && [ "${SHM:-0}" -gt $((24 * 1024 * 1024)) ] && MODEL8=/dev/shm/signal-gpu-model-8b
SECTIONS=("$PY" bench/gpu_sections.py --device "$DEVICE" --data-dir "$WORK/data" --deadline @END@ --seconds 600 $TINY "${THREADS[@]}")
KERNEL_TESTS=(tests/cuda/test_lora_ops_cuda.py tests/cuda/test_multilora_cuda.py)

# Most important first (docs/GPU_CHECKS.md); what the deadline cannot reach prints a skip line.
part install 30 bash -c install_wheels
part env 30 "$PY" bench/gpu_bench.py env
part model 40 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODEL" --device "$DEVICE" $TINY
part train_1b 110 "${SECTIONS[@]}" train_1b --model "$MODEL"
part decode_1b 75 "${SECTIONS[@]}" decode_1b --model "$MODEL"
part kernel_tests 45 bash -c 'pytest_part kernel_tests "$@"' _ "${KERNEL_TESTS[@]}"
part kernels 40 "${SECTIONS[@]}" kernels
part model_8b 45 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODEL8" --device "$DEVICE" --shape 8b $TINY
part eight_b 100 "${SECTIONS[@]}" eight_b --model "$MODEL8"
rm -rf "$MODEL8"
part rl_1b 50 "${SECTIONS[@]}" rl_1b --model "$MODEL"
part cuda_tests 60 bash -c 'pytest_part cuda_tests tests/cuda "${@/#/--ignore=}"' _ "${KERNEL_TESTS[@]}"
# Qwen3-30B-A3B's shape, 2 of its layers (~2.8 GB): 4 co-batched expert-LoRA runs against one run's ceiling
part model_moe 25 "$PY" bench/gpu_bench.py model --assets "$ASSETS" --out "$MODELMOE" --device "$DEVICE" --shape moe $TINY
part moe 40 "${SECTIONS[@]}" moe --model "$MODELMOE"
rm -rf "$MODELMOE"

summary="" took=""
for name in "${PARTS[@]}"; do summary+="\"$name\": \"${RC[$name]:-none}\", "; took+="\"$name\": ${PART_S[$name]:-0}, "; done
emit "{\"gpu_sh\": \"done\", \"device\": \"$DEVICE\", \"seconds\": $SECONDS, \"budget_s\": $BUDGET, \"exit_codes\": {${summary%, }}, \"part_seconds\": {${took%, }}}"
rm -rf "$WORK/data" "$MODEL"
if [ -n "${OUT:-}" ]; then
  (cd "$WORK" && tar -czf "$OUT/gpu-logs.tar.gz" logs ./*.xml 2>/dev/null || tar -czf "$OUT/gpu-logs.tar.gz" logs)
fi
