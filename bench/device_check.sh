#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU, torch and nvcc but no network:
#   1. builds vllm_lite._C in place for this GPU's architecture only,
#   2. runs the CUDA kernel tests (pytest tests/kernels -k cuda),
#   3. runs the kernel benchmark (bench/kernels.py --device cuda),
# and writes logs and tables to OUTDIR (default: $OUT if set, else bench/results/device).
# Each stage has a time limit so the whole script ends in under 8 minutes; a stage that
# fails does not stop the later ones. OUTDIR/summary.md gives each stage's status.
#
#   bash bench/device_check.sh [OUTDIR]
#
# Files in OUTDIR (at most 8): summary.md, env.log, build.log, tests.log, bench.log,
# kernels_cuda_<stamp>.md, kernels_cuda_<stamp>.json.
# Stage limits (seconds) can be changed with BUILD_S, TESTS_S, BENCH_S; TOTAL_S (default
# 450) caps the sum, the benchmark getting what is left.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUTDIR="${1:-${OUT:-$ROOT/bench/results/device}}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
# A rerun replaces the previous run's files (keeps OUTDIR at 7 files).
rm -f "$OUTDIR"/kernels_cuda_*.md "$OUTDIR"/kernels_cuda_*.json
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TOTAL_S="${TOTAL_S:-450}"
BUILD_S="${BUILD_S:-270}"
TESTS_S="${TESTS_S:-90}"
BENCH_S="${BENCH_S:-180}"
START=$(date +%s)
SUMMARY="$OUTDIR/summary.md"
declare -a STAGES=()

elapsed() { echo $(( $(date +%s) - START )); }
left() { echo $(( TOTAL_S - $(elapsed) )); }
limit() {  # limit WANTED: WANTED capped by the time left (at least 10 s)
  local l; l=$(left)
  (( l < $1 )) && echo $(( l > 10 ? l : 10 )) || echo "$1"
}
lastline() {  # the last line of a log that looks like an error, for the summary
  grep -iE 'error|failed|no such|not found|killed' "$1" 2>/dev/null | tail -n 1 | cut -c1-160 | tr '|' '/'
}
stage() {  # stage NAME RC SECONDS NOTE
  local status
  case "$2" in
    0) status="ok" ;;
    124|137) status="TIMEOUT (rc $2)" ;;
    skip) status="skipped" ;;
    *) status="FAILED (rc $2)" ;;
  esac
  STAGES+=("| $1 | $status | $3 s | $4 |")
  echo "== $1: $status in $3 s ($4)"
}

# ---- environment -------------------------------------------------------------------
{
  echo "date: $(date -Is)"; echo "host: $(hostname)"; echo "root: $ROOT"
  echo "python: $("$PY" -c 'import sys; print(sys.version)' 2>&1)"
  echo "nvcc: $(command -v nvcc || echo 'not on PATH')"; nvcc --version 2>&1 | tail -n 2
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm,clocks.max.mem \
    --format=csv 2>&1 || echo "nvidia-smi failed"
  "$PY" - <<'EOF' 2>&1
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", p.name, "capability %d.%d" % (p.major, p.minor),
          "memory %.1f GiB" % (p.total_memory / 2**30), "L2 %d MiB" % (p.L2_cache_size >> 20))
for mod in ("pytest", "hypothesis", "flash_attn", "tqdm", "ninja"):
    try:
        m = __import__(mod)
        print(mod, getattr(m, "__version__", "?"))
    except Exception as e:
        print(mod, "MISSING:", type(e).__name__, e)
EOF
  echo "nproc: $(nproc)"
} > "$OUTDIR/env.log" 2>&1
cat "$OUTDIR/env.log"

ARCH="$("$PY" -c 'import torch; c = torch.cuda.get_device_capability(); print("%d.%d" % c)' 2>/dev/null)"
if [[ -z "$ARCH" ]]; then
  echo "no CUDA device visible to torch; building for 9.0 anyway" | tee -a "$OUTDIR/env.log"
  ARCH="9.0"
fi

# ---- 1. build ----------------------------------------------------------------------
T0=$(date +%s)
L=$(limit "$BUILD_S")
{
  echo "TORCH_CUDA_ARCH_LIST=$ARCH VLLM_LITE_TARGET=cuda MAX_JOBS=${MAX_JOBS:-$(nproc)}" \
       "$PY setup.py build_ext --inplace   (limit ${L} s)"
  TORCH_CUDA_ARCH_LIST="$ARCH" VLLM_LITE_TARGET=cuda MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    NVCC_THREADS="${NVCC_THREADS:-2}" \
    timeout -k 10 "$L" "$PY" setup.py build_ext --inplace
} > "$OUTDIR/build.log" 2>&1
RC=$?
DT=$(( $(date +%s) - T0 ))
echo "build finished with rc $RC in $DT s" >> "$OUTDIR/build.log"
tail -n 5 "$OUTDIR/build.log"
NOTE="sm ${ARCH}, limit ${L} s, build.log"
[[ $RC -ne 0 ]] && NOTE="$NOTE: $(lastline "$OUTDIR/build.log")"
stage build "$RC" "$DT" "$NOTE"
SO=""
# Only an extension this build produced counts (never a stale one from another build).
[[ $RC -eq 0 ]] && SO="$(ls vllm_lite/_C*.so 2>/dev/null | head -n 1)"

# ---- 2. CUDA kernel tests ----------------------------------------------------------
T0=$(date +%s)
if ! "$PY" -c 'import pytest' >/dev/null 2>&1; then
  echo "pytest is not installed for $PY (and there is no network to install it):" \
       "CUDA kernel tests not run" > "$OUTDIR/tests.log"
  stage tests skip 0 "pytest missing, tests.log"
elif [[ -z "$SO" ]]; then
  echo "the build failed (no fresh vllm_lite/_C*.so): tests not run; see build.log" > "$OUTDIR/tests.log"
  stage tests skip 0 "no extension"
else
  L=$(limit "$TESTS_S")
  # tests/kernels parametrize by device/backend; the CUDA cases have "cuda" in their ids.
  {
    echo "$PY -m pytest tests/kernels -x -q -k cuda ${PYTEST_ARGS:-}   (limit ${L} s)"
    timeout -s INT -k 15 "$L" "$PY" -m pytest tests/kernels -x -q -k cuda -p no:cacheprovider \
      ${PYTEST_ARGS:-}
  } > "$OUTDIR/tests.log" 2>&1
  RC=$?
  DT=$(( $(date +%s) - T0 ))
  tail -n 15 "$OUTDIR/tests.log"
  NOTE="limit ${L} s, tests.log: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUTDIR/tests.log" | tail -n 1)"
  [[ $RC -eq 5 ]] && NOTE="$NOTE; pytest rc 5: no test selected by -k cuda"
  stage tests "$RC" "$DT" "$NOTE"
fi

# ---- 3. kernel benchmark -----------------------------------------------------------
T0=$(date +%s)
if [[ -z "$SO" ]]; then
  echo "the build failed: benchmark not run; see build.log" > "$OUTDIR/bench.log"
  stage bench skip 0 "no extension"
else
  L=$(limit "$BENCH_S")
  # The issue's CUDA grid; the target shape (fp16, 32/32x128, batch 64, ctx 1024) runs
  # first, and the benchmark starts no new shape 30 s before its limit so that the table
  # is always written (SIGINT from timeout also makes it write what it has).
  DEADLINE=$(awk -v l="$L" 'BEGIN { d = (l - 30) / 60; if (d < 0.2) d = 0.2; printf "%.2f", d }')
  {
    echo "$PY bench/kernels.py --device cuda --out $OUTDIR --deadline-min $DEADLINE ${BENCH_ARGS:-}   (limit ${L} s)"
    timeout -s INT -k 20 "$L" "$PY" bench/kernels.py --device cuda --out "$OUTDIR" \
      --deadline-min "$DEADLINE" ${BENCH_ARGS:-}
  } > "$OUTDIR/bench.log" 2>&1
  RC=$?
  DT=$(( $(date +%s) - T0 ))
  NOTE="limit ${L} s, bench.log"
  [[ $RC -eq 1 ]] && NOTE="$NOTE; some kernel WRONG or failing (see table)"
  [[ $RC -ne 0 && $RC -ne 1 ]] && NOTE="$NOTE: $(lastline "$OUTDIR/bench.log")"
  stage bench "$RC" "$DT" "$NOTE"
fi

# ---- summary -----------------------------------------------------------------------
{
  echo "# device_check $(date -Is)"
  echo
  grep -E '^(torch|gpu|pytest|flash_attn) ' "$OUTDIR/env.log" | sed 's/^/- /'
  echo
  echo "| stage | status | time | notes |"
  echo "|---|---|---|---|"
  printf '%s\n' "${STAGES[@]}"
  echo
  echo "total $(elapsed) s"
  MD="$(ls -t "$OUTDIR"/kernels_cuda_*.md 2>/dev/null | head -n 1)"
  if [[ -n "$MD" ]]; then
    echo
    echo "Benchmark targets (from $(basename "$MD")):"
    echo
    sed -n '/^### Targets/,$p' "$MD" | tail -n +2
  fi
  if grep -qE 'FAILED|ERROR' "$OUTDIR/tests.log" 2>/dev/null; then
    echo
    echo "Test failures:"
    echo
    grep -E '^(FAILED|ERROR)' "$OUTDIR/tests.log" | head -n 20
  fi
} > "$SUMMARY"
cat "$SUMMARY"
# Exit status: 0 only when every stage passed.
for s in "${STAGES[@]}"; do [[ "$s" == *"| ok |"* ]] || exit 1; done
exit 0
