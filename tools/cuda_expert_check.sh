#!/usr/bin/env bash
# One device call for the persistent expert kernel (issue 19): correctness stages, timing, compute-sanitizer,
# each in its own process under `timeout`; logs in $OUT/stages.log, rows in $OUT/cuda_expert.jsonl, summary last.
#   bash tools/cuda_expert_check.sh            (on the H200; ~8 min)
# Cubins come from $VLA_RT_CACHE when precompiled (python tools/cuda_expert_check.py precompile), else nvcc builds
# them on first use.
set -u
cd "$(dirname "$0")/.."
export OUT=${OUT:-/tmp/cuda_expert_out} PYTHONUNBUFFERED=1
export VLA_RT_CACHE=${VLA_RT_CACHE:-$PWD/.cubin_cache}
mkdir -p "$OUT"
LOG="$OUT/stages.log"
stage() {  # stage TIMEOUT NAME CMD...
  local t=$1 name=$2 start rc
  shift 2
  start=$(date +%s)
  echo "== $name (timeout ${t}s)" >>"$LOG"
  timeout -k 5 "$t" "$@" >>"$LOG" 2>&1
  rc=$?
  echo "== $name rc=$rc $(($(date +%s) - start))s" | tee -a "$LOG"
  [ $rc -eq 0 ] || tail -n 25 "$LOG" | grep -v "^== " | tail -n 12
}
{ nvidia-smi -L; nvcc --version | tail -n 1; } 2>&1 | tee -a "$LOG"
STAGES=${STAGES:-diag replay broken accuracy bench memcheck racecheck}
TILING_ARG=${TILING:+--tiling $TILING}  # the variant the correctness stages check, e.g. TILING=a_ring_kb=64,keys_per_split=128
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
for s in $STAGES; do
  case $s in
    diag) stage 80 diag python3 tools/cuda_expert_check.py diag $TILING_ARG ;;
    replay) stage 50 replay python3 tools/cuda_expert_check.py replay $TILING_ARG ;;
    broken) stage 50 broken python3 tools/cuda_expert_check.py broken $TILING_ARG ;;
    accuracy) stage 100 accuracy python3 tools/cuda_expert_check.py accuracy --cases ${CASES:-3} --draws ${DRAWS:-5} $TILING_ARG ;;
    bench) stage 200 bench python3 tools/cuda_expert_check.py bench --cases ${BENCH_CASES:-2} --sm-list ${SMS:-132,100} ${BENCH_ARGS:-} ;;
    memcheck) stage 80 memcheck "$SAN" --tool memcheck --print-limit 5 python3 tools/cuda_expert_check.py once --depth 1 $TILING_ARG ;;
    racecheck) stage 80 racecheck "$SAN" --tool racecheck --print-limit 5 python3 tools/cuda_expert_check.py once --depth 1 $TILING_ARG ;;
  esac
done
echo "== rows"
cat "$OUT/cuda_expert.jsonl" 2>/dev/null
