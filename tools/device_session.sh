#!/usr/bin/env bash
# One device call per stage: install, then the stage's checks/timings; full logs under $OUT, a short table last.
#   bash tools/device_session.sh check   GPU tests, quick kernel bench, 20-draw accuracy, triton/graph bench
#   bash tools/device_session.sh tune    GPU tests, autotune (budgeted), 100-draw accuracy
#   bash tools/device_session.sh full    latency bench (all backends), streaming bench, runtime latency, kernels
#   bash tools/device_session.sh compile the torch.compile(max-autotune) row alone
#   bash tools/device_session.sh fused      fused RMS/RoPE GEMMs: their GPU tests, kernel A/B vs the kernels they replace
#   bash tools/device_session.sh fused_ab   engine A/B of fuse_rms / fuse_rope (off, rms, rope, both, expert only)
#   bash tools/device_session.sh fused_tune tune the fused GEMMs (budgeted), then the engine A/B on the tuned table
set -uo pipefail
STAGE=${1:-check}
FINAL_OUT=${OUT:-/tmp/out}; OUT=/tmp/results; mkdir -p "$OUT" "$FINAL_OUT"
# the device returns at most 8 files: everything goes into one archive, plus the short logs beside it
trap 'tar czf "$FINAL_OUT/results.tgz" -C /tmp results; cp "$OUT"/*.log "$FINAL_OUT"/ 2>/dev/null | head -0' EXIT
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if ls .whl/*.whl > /dev/null 2>&1; then  # pyserial for the runtime (not in the GPU image)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stamp "installed"
gpu_tests() {
  python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py tests/test_gpu_engine.py \
    tests/test_gpu_streaming.py > "$OUT/gpu_tests.log" 2>&1
  stamp "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
}
case "$STAGE" in
  check)
    gpu_tests
    python3 -m vla_rt.bench.accuracy --draws 20 --out "$OUT" > "$OUT/accuracy.log" 2>&1
    stamp "accuracy done"
    python3 -m vla_rt.cli bench --backends cuda-graph-torch,triton --cases "1,0,63;3,0,63" --iters 100 --out "$OUT" > "$OUT/bench.log" 2>&1
    stamp "bench done"
    tail -5 "$OUT/accuracy.log"; grep -E "median|skipped" "$OUT/bench.log" ;;
  tune)
    gpu_tests
    python3 -m vla_rt.triton_kernels.tune --quick --groups ${TUNE_GROUPS:-expert,attention,vlm,siglip} --views 1,3 \
      --prompts 0,20 --chunks 63,50 --budget-s ${TUNE_BUDGET:-300} --overlap --out "$OUT/NVIDIA-H200.json" \
      --log "$OUT/tune_log.json" > "$OUT/tune.log" 2>&1
    cp "$OUT/NVIDIA-H200.json" "$FINAL_OUT/" ; stamp "tune: $(tail -3 "$OUT/tune.log" | tr '\n' ' ')"
    cp "$OUT/NVIDIA-H200.json" triton_kernels/configs/NVIDIA-H200.json  # the accuracy run below uses the tuned table
    python3 -m vla_rt.bench.accuracy --draws 100 --out "$OUT" > "$OUT/accuracy.log" 2>&1
    stamp "accuracy done"; tail -5 "$OUT/accuracy.log" ;;
  full)
    python3 -m vla_rt.cli bench --backends reference,cuda-graph-torch,triton --out "$OUT" > "$OUT/bench.log" 2>&1
    stamp "latency bench done"
    python3 -m vla_rt.bench.streaming --views 1 2 3 --seconds 2 --out "$OUT" > "$OUT/streaming.log" 2>&1
    stamp "streaming done"
    python3 -m vla_rt.bench.runtime_latency --views 1 2 --seconds 5 --out "$OUT" > "$OUT/runtime.log" 2>&1
    stamp "runtime latency done"
    python3 -c "from vla_rt.triton_kernels.bench_kernels import bench_kernels; bench_kernels(views=(1, 3), prompts=(0,), chunks=(63,), path='$OUT/kernels.json')" > "$OUT/kernels.log" 2>&1
    stamp "kernel bench done"
    grep -E "median|skipped" "$OUT/bench.log"; tail -6 "$OUT/streaming.log"; tail -3 "$OUT/runtime.log" ;;
  baseline)
    mkdir -p "$OUT/graph" "$OUT/compile"
    python3 -m vla_rt.cli bench --backends cuda-graph-torch --out "$OUT/graph" > "$OUT/graph.log" 2>&1
    stamp "graph baseline done"
    python3 -m vla_rt.cli bench --backends reference+compile --cases "1,0,63" --compile-budget ${COMPILE_BUDGET:-240} \
      --out "$OUT/compile" > "$OUT/compile.log" 2>&1
    stamp "compile row done"; grep -E "median|skipped" "$OUT/graph.log" "$OUT/compile.log" ;;
  fused)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_gpu_engine.py \
      -k "fused or fusions" > "$OUT/gpu_tests_fused.log" 2>&1
    stamp "fused gpu tests: $(tail -1 "$OUT/gpu_tests_fused.log")"
    python3 -m vla_rt.triton_kernels.bench_kernels --fused-only --views 1,3 --prompts 0,20 --chunks 63,50 \
      --out "$OUT/kernels_fused.json" > "$OUT/kernels_fused.log" 2>&1
    stamp "fused kernel bench done"
    grep -E "passed|failed|error" "$OUT/gpu_tests_fused.log" | tail -3; cat "$OUT/kernels_fused.log" ;;
  fused_ab)
    python3 tools/bench_fused.py --cases "${FUSED_CASES:-1,0,63;3,20,50}" --combos off,rms,rope,both,expert \
      --iters 100 --out "$OUT" > "$OUT/bench_fused.log" 2>&1
    stamp "engine A/B done"; cat "$OUT"/fused_*.md 2>/dev/null || tail -20 "$OUT/bench_fused.log" ;;
  fused_tune)
    python3 -m vla_rt.triton_kernels.tune --quick --groups fused --views 1,3 --prompts 0,20 --chunks 63,50 \
      --budget-s ${TUNE_BUDGET:-240} --overlap --out "$OUT/NVIDIA-H200.json" --log "$OUT/tune_fused_log.json" \
      > "$OUT/tune_fused.log" 2>&1
    cp "$OUT/NVIDIA-H200.json" "$FINAL_OUT/"; stamp "tune: $(tail -3 "$OUT/tune_fused.log" | tr '\n' ' ')"
    cp "$OUT/NVIDIA-H200.json" triton_kernels/configs/NVIDIA-H200.json  # the A/B below uses the tuned table
    python3 tools/bench_fused.py --cases "1,0,63" --combos off,both,expert --iters 100 --out "$OUT" \
      > "$OUT/bench_fused.log" 2>&1
    stamp "engine A/B done"; grep -E "vs unfused" "$OUT/tune_fused.log"; cat "$OUT"/fused_*.md ;;
  compile)
    python3 -m vla_rt.cli bench --backends reference+compile --cases "1,0,63" --compile-budget ${COMPILE_BUDGET:-300} --out "$OUT" > "$OUT/compile.log" 2>&1
    stamp "compile row done"; cat "$OUT/compile.log" | tail -3 ;;
esac
