#!/usr/bin/env bash
# One device call: install, GPU tests, accuracy, benchmarks; full logs under $OUT, a short table last.
# Usage (device tool): bash tools/device_session.sh <stage> ; stages: check | full
set -uo pipefail
STAGE=${1:-check}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stamp "installed"
python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py tests/test_gpu_engine.py > "$OUT/gpu_tests.log" 2>&1
stamp "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
if [ "$STAGE" = check ]; then
  python3 -c "from vla_rt.triton_kernels.bench_kernels import bench_kernels; bench_kernels(views=(1, 3), prompts=(0,), chunks=(63,), path='$OUT/kernels.json')" > "$OUT/kernels.log" 2>&1 || true
  stamp "kernel bench done"
  python3 -m vla_rt.bench.accuracy --draws 20 --out "$OUT" > "$OUT/accuracy.log" 2>&1
  stamp "accuracy: $(tail -4 "$OUT/accuracy.log" | tr '\n' ' ')"
  vla-rt bench --backends cuda-graph-torch,triton --cases "1,0,63;2,0,63;3,0,63" --iters 100 --out "$OUT" > "$OUT/bench.log" 2>&1
  stamp "bench done"
  cat "$OUT/kernels.log" | tail -40
  grep -E "median|skipped" "$OUT/bench.log"
fi
