#!/usr/bin/env bash
# One device call per stage: install, then the stage's checks/timings; full logs under $OUT, a short table last.
#   bash tools/device_session.sh check   GPU tests, quick kernel bench, 20-draw accuracy, triton/graph bench
#   bash tools/device_session.sh tune    GPU tests, autotune (budgeted), 100-draw accuracy
#   bash tools/device_session.sh full    latency bench (all backends), streaming bench, runtime latency, kernels
#   bash tools/device_session.sh gpu_all every GPU test (~9 min: 224 took 330 s; the check stage runs three files)
#   bash tools/device_session.sh compile the torch.compile(max-autotune) row: COMPILE_CASES, COMPILE_BUDGET s each, COMPILE_CD
#   bash tools/device_session.sh fused      fused RMS/RoPE GEMMs: their GPU tests, kernel A/B vs the kernels they replace
#   bash tools/device_session.sh fused_ab   engine A/B of fuse_rms / fuse_rope (off, rms, rope, both, expert only)
#   bash tools/device_session.sh pdl        GPU tests with PDL on (incl. PDL vs plain bitwise), engine A/B of PDL and expert fusions
#   bash tools/device_session.sh final      after a change: triton/graph latency, streaming, accuracy (≤ 8 min; FINAL_AB=1 adds the PDL A/B)
#   bash tools/device_session.sh next       rms_partials GPU tests + A/B, the 100-draw accuracy of the defaults
#   bash tools/device_session.sh fused_tune tune the fused GEMMs (budgeted), then the engine A/B on the tuned table
#   bash tools/device_session.sh combine    combine_rms GPU tests, expert attention/RoPE-QKV re-tune, A/B, profile
#   bash tools/device_session.sh l2pf       the expert's L2 weight prefetch: bitwise GPU test, A/B of variants, profile
#   bash tools/device_session.sh tma_modes  tools/bench_tma.py one mode a process; TMA_TUNE=1 re-tunes with the safe ones
#   bash tools/device_session.sh tma_expert TMA GPU tests, TUNE_GROUPS (default expert) re-tuned with TMA candidates, engine timing
#   bash tools/device_session.sh expert_layer  persistent expert-layer kernel: GPU tests, engine A/B, config sweep (SWEEP)
#   bash tools/device_session.sh gluon   tools/gluon_skinny_gemm.py (compile-checked only so far): Gluon vs Triton vs cuBLAS
#   bash tools/device_session.sh retune  TUNE_GROUPS at TUNE_VIEWS (default the 2-view shapes), engine latency before/after
#   bash tools/device_session.sh profile one part's kernels (PROFILE_PARTS step/vision/prefix, PROFILE_CASES) per PROFILE_COMBOS
#   bash tools/device_session.sh skinny  Gluon expert GEMMs (skinny_gluon): their GPU tests, engine A/B off/default/skinny
#   bash tools/device_session.sh mlp     the expert MLP in one Gluon launch (fused_mlp): GPU tests, engine A/B, profile
#   bash tools/device_session.sh streamk Stream-K GEMMs: GPU tests, SK_GROUPS re-tuned with them, engine before/after
set -uo pipefail
STAGE=${1:-check}
FINAL_OUT=${OUT:-/tmp/out}; OUT=/tmp/results
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"  # a warm machine keeps /tmp: no earlier stage's files in this archive
# the device returns at most 8 files: everything goes into one archive, plus the short logs beside it
trap 'tar czf "$FINAL_OUT/results.tgz" -C /tmp results; cp "$OUT"/*.log "$FINAL_OUT"/ 2>/dev/null | head -0' EXIT
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # tools/*.py import vla_rt from the checkout
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if ls .whl/*.whl > /dev/null 2>&1; then  # pyserial for the runtime (not in the GPU image)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stamp "installed"
gpu_tests() {  # (under a timeout: a hung kernel must not eat the call)
  timeout ${GPU_TESTS_S:-240} python3 -m pytest -q -m gpu -x -p no:cacheprovider tests/test_kernels_gpu.py tests/test_gpu_engine.py \
    tests/test_gpu_streaming.py > "$OUT/gpu_tests.log" 2>&1
  stamp "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
}
tune_install_bench() {  # tune_install_bench GROUPS VIEWS PROMPTS "BENCH_CASES" LOG_NAME [extra tune flags...]: tune
  # (TUNE_TMA modes, default 0-3; TUNE_CANDIDATES / TUNE_BUDGET / TUNE_S), install the table, time the engine
  local groups=$1 views=$2 prompts=$3 cases=$4 log=$5; shift 5
  timeout ${TUNE_S:-330} python3 -m vla_rt.triton_kernels.tune "$@" --groups "$groups" --views "$views" \
    --prompts "$prompts" --chunks 63,50 --tma-modes ${TUNE_TMA:-0,1,2,3} --max-candidates ${TUNE_CANDIDATES:-24} \
    --budget-s ${TUNE_BUDGET:-300} --overlap --out "$OUT/NVIDIA-H200.json" --log "$OUT/$log" > "$OUT/tune.log" 2>&1
  cp "$OUT/NVIDIA-H200.json" "$OUT/tune.log" "$FINAL_OUT/"; stamp "tune: $(tail -1 "$OUT/tune.log")"
  cp "$OUT/NVIDIA-H200.json" triton_kernels/configs/NVIDIA-H200.json
  timeout 120 python3 -m vla_rt.cli bench --backends triton --cases "$cases" --iters 200 --out "$OUT/after" \
    > "$OUT/bench_after.log" 2>&1
  stamp "after: $(grep median "$OUT/bench_after.log" | tr '\n' ' ')"
  grep -E " us \(" "$OUT/tune.log" | cut -c1-150
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
    python3 -m vla_rt.triton_kernels.tune --quick --groups ${TUNE_GROUPS:-expert,attention,vlm,siglip} --views 1,2,3 \
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
  pdl)
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_gpu_streaming.py \
      tests/test_kernels_gpu.py -k "pdl or streaming or deterministic or matches_fp32 or bf16" \
      > "$OUT/gpu_tests_pdl.log" 2>&1
    stamp "gpu tests: $(tail -1 "$OUT/gpu_tests_pdl.log")"
    python3 tools/bench_fused.py --cases "${PDL_CASES:-1,0,63;3,0,63}" --combos ${PDL_COMBOS:-off,nopdl,default,pdl_early} \
      --iters 100 --out "$OUT" > "$OUT/bench_pdl.log" 2>&1
    stamp "engine A/B done"; grep -E "FAILED|passed|failed" "$OUT/gpu_tests_pdl.log" | tail -5
    cat "$OUT"/fused_*.md 2>/dev/null || tail -20 "$OUT/bench_pdl.log" ;;
  final)  # the numbers to commit after a kernel/engine change: triton + graph latency, streaming, A/B, accuracy
    mkdir -p "$OUT/lat" "$OUT/stream" "$OUT/ab" "$OUT/acc"
    if [ -n "${FINAL_TESTS:-}" ]; then  # every GPU-marked kernel and engine test first
      timeout 90 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py tests/test_gpu_engine.py \
        > "$OUT/gpu_tests.log" 2>&1
      stamp "gpu tests: $(tail -1 "$OUT/gpu_tests.log")"
    fi
    if [ -n "${FINAL_EXPERT_LAYER:-}" ]; then  # the persistent expert-layer kernel's GPU tests (opt-in fusion)
      timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_expert_layer.py > "$OUT/gpu_expert_layer.log" 2>&1
      stamp "expert layer tests: $(tail -1 "$OUT/gpu_expert_layer.log")"
    fi
    timeout 200 python3 -m vla_rt.cli bench --backends cuda-graph-torch,triton --out "$OUT/lat" > "$OUT/bench.log" 2>&1
    stamp "latency bench done"
    timeout 90 python3 -m vla_rt.bench.streaming --views 1 2 3 --seconds 2 --out "$OUT/stream" > "$OUT/streaming.log" 2>&1
    stamp "streaming done"
    if [ -n "${FINAL_AB:-}" ]; then
      timeout 100 python3 tools/bench_fused.py --cases "1,0,63;3,0,63" --combos off,nopdl,default --iters 100 \
        --out "$OUT/ab" > "$OUT/ab.log" 2>&1
      stamp "A/B done"
    fi
    timeout 150 python3 -m vla_rt.bench.accuracy --draws 100 --out "$OUT/acc" > "$OUT/accuracy.log" 2>&1
    stamp "accuracy done"
    timeout 40 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_streaming.py > "$OUT/gpu_streaming.log" 2>&1
    stamp "streaming tests: $(tail -1 "$OUT/gpu_streaming.log")"
    grep -E "median|skipped" "$OUT/bench.log" | grep triton; tail -6 "$OUT/streaming.log"; cat "$OUT"/ab/fused_*.md 2>/dev/null
    tail -4 "$OUT/accuracy.log" ;;
  next)  # what this session could not run: rms_partials on the GPU, the full 100-draw accuracy of the defaults
    timeout 120 python3 tools/profile_engine.py --case 1,0,63 --combos default,nopdl,partials --out "$OUT" \
      > "$OUT/profile.log" 2>&1
    stamp "profile done"
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py tests/test_kernels_gpu.py \
      -k "rms_partials or pdl" > "$OUT/gpu_tests_next.log" 2>&1
    stamp "gpu tests: $(tail -1 "$OUT/gpu_tests_next.log")"
    timeout 130 python3 tools/bench_fused.py --cases "1,0,63;3,0,63" --combos off,default,partials,partials_expert \
      --iters 100 --out "$OUT" > "$OUT/ab.log" 2>&1
    stamp "A/B done"
    timeout 170 python3 -m vla_rt.bench.accuracy --draws 100 --out "$OUT" > "$OUT/accuracy.log" 2>&1
    stamp "accuracy done"; grep -E "==|layer:" "$OUT/profile.log"; cat "$OUT"/fused_*.md; tail -4 "$OUT/accuracy.log" ;;
  combine)  # combine_rms: its GPU tests, the expert attention + RoPE-QKV re-tune, the engine A/B, a step profile
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py -k "norm_fusions" \
      > "$OUT/gpu_tests_combine.log" 2>&1
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_fused.py -k "rms_out" >> "$OUT/gpu_tests_combine.log" 2>&1
    stamp "gpu tests: $(grep -E "passed|failed" "$OUT/gpu_tests_combine.log" | tr '\n' ' ')"
    timeout 200 python3 -m vla_rt.triton_kernels.tune --groups expert_attention,expert_fused --views 1,2,3 \
      --prompts 0,20 --chunks 63,50 --max-candidates 30 --budget-s 170 --overlap --out "$OUT/NVIDIA-H200.json" \
      --log "$OUT/tune_log.json" > "$OUT/tune.log" 2>&1
    stamp "tune: $(tail -2 "$OUT/tune.log" | tr '\n' ' ')"
    cp "$OUT/NVIDIA-H200.json" triton_kernels/configs/NVIDIA-H200.json  # what the A/B below runs on
    timeout 150 python3 tools/bench_fused.py --cases "1,0,63;3,0,63" --combos off,default,combine_rms,combine_rms_expert \
      --iters 100 --out "$OUT" > "$OUT/ab.log" 2>&1
    stamp "A/B done"
    timeout 90 python3 tools/profile_engine.py --case 1,0,63 --combos default,combine_rms --out "$OUT" \
      > "$OUT/profile.log" 2>&1
    stamp "profile done"; grep -E "vs|us " "$OUT/tune.log" | tail -20; grep -E "==|layer:" "$OUT/profile.log"
    cat "$OUT"/fused_*.md ;;
  l2pf)  # the expert's L2 weight prefetch: bitwise GPU test, engine A/B of its variants (+ combine_rms), profile
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_gpu_engine.py -k "l2_prefetch" \
      > "$OUT/gpu_tests_l2pf.log" 2>&1
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/test_kernels_prefetch.py >> "$OUT/gpu_tests_l2pf.log" 2>&1
    stamp "gpu tests: $(grep -E "passed|failed" "$OUT/gpu_tests_l2pf.log" | tr '\n' ' ')"
    timeout 240 python3 tools/bench_fused.py --cases "1,0,63;3,0,63" \
      --combos off,default,l2pf,l2pf_mlp,l2pf_combine --iters 100 --out "$OUT" > "$OUT/ab.log" 2>&1
    stamp "A/B done"
    timeout 90 python3 tools/profile_engine.py --case 1,0,63 --combos default,l2pf --out "$OUT" > "$OUT/profile.log" 2>&1
    stamp "profile done"; grep -E "==|layer:" "$OUT/profile.log"; cat "$OUT"/fused_*.md ;;
  fused_tune)
    python3 -m vla_rt.triton_kernels.tune --quick --groups fused --views 1,3 --prompts 0,20 --chunks 63,50 \
      --budget-s ${TUNE_BUDGET:-240} --overlap --out "$OUT/NVIDIA-H200.json" --log "$OUT/tune_fused_log.json" \
      > "$OUT/tune_fused.log" 2>&1
    cp "$OUT/NVIDIA-H200.json" "$FINAL_OUT/"; stamp "tune: $(tail -3 "$OUT/tune_fused.log" | tr '\n' ' ')"
    cp "$OUT/NVIDIA-H200.json" triton_kernels/configs/NVIDIA-H200.json  # the A/B below uses the tuned table
    python3 tools/bench_fused.py --cases "1,0,63" --combos off,both,expert --iters 100 --out "$OUT" \
      > "$OUT/bench_fused.log" 2>&1
    stamp "engine A/B done"; grep -E "vs unfused" "$OUT/tune_fused.log"; cat "$OUT"/fused_*.md ;;
  tma_modes)  # each TMA mode in its own process (a mode that hangs on this Triton is cut by its timeout);
    # TMA_TUNE=1: then re-tune the wide GEMMs with the modes that finished, and time the engine
    for m in ${TMA_MODES:-1 2 3}; do
      timeout ${MODE_TIMEOUT:-60} python3 tools/bench_tma.py --modes $m --out "$OUT/bench_tma.json" > "$OUT/bench_tma_$m.log" 2>&1
      stamp "mode $m: rc $?" | tee -a "$OUT/stamps.log"; grep -E "table|error|Error" "$OUT/bench_tma_$m.log" | head -6
    done
    if [ -n "${TMA_TUNE:-}" ]; then
      SAFE=0; for m in ${TMA_MODES:-1 2 3}; do grep -q "mode $m: rc 0" "$OUT/stamps.log" && SAFE="$SAFE,$m"; done
      stamp "tuning with tma modes $SAFE"
      TUNE_TMA=$SAFE TUNE_CANDIDATES=${TUNE_CANDIDATES:-20} TUNE_BUDGET=${TUNE_BUDGET:-170} TUNE_S=230 \
        tune_install_bench vlm,siglip 1,3 0,20 "1,0,63;3,0,63" tune_log_tma.json
    fi
    python3 - "$OUT/bench_tma.json" <<'PY'
import json, sys, collections
best = collections.defaultdict(dict)
for r in json.load(open(sys.argv[1])):
    if "us" in r:
        k = r["config"]
        best[r["shape"]][k] = min(best[r["shape"]].get(k, 1e9), r["us"])
for shape, d in best.items():
    print(f"{shape:<18} " + "  ".join(f"{k} {v:7.2f}" for k, v in sorted(d.items())))
PY
    ;;
  tma_expert)  # TMA GPU tests, then TUNE_GROUPS re-tuned with TMA candidates, engine timing
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_kernels_gpu.py -k "test_tma_" -rs \
      > "$OUT/gpu_tests_tma.log" 2>&1
    stamp "tma gpu tests: $(tail -1 "$OUT/gpu_tests_tma.log")"
    TUNE_CANDIDATES=${TUNE_CANDIDATES:-40} TUNE_BUDGET=${TUNE_BUDGET:-150} TUNE_S=260 \
      tune_install_bench "${TUNE_GROUPS:-expert}" 1,3 0,20 "1,0,63;3,0,63" tune_log_tma.json ;;
  expert_layer)  # the persistent expert-layer kernel: its GPU tests (under timeouts: a broken barrier hangs), the
    # engine A/B against the default expert path, a config sweep on the 18-layer step, the engine GPU test
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_expert_layer.py \
      > "$OUT/gpu_tests_expert_layer.log" 2>&1
    rc=$?; stamp "kernel tests (rc $rc): $(tail -1 "$OUT/gpu_tests_expert_layer.log")"
    if [ $rc -ne 0 ]; then tail -40 "$OUT/gpu_tests_expert_layer.log"; exit 1; fi
    timeout 240 python3 tools/bench_fused.py --cases "${AB_CASES:-1,0,63;3,0,63}" --combos default,expert_layer \
      --iters 100 --out "$OUT/ab" > "$OUT/ab_expert_layer.log" 2>&1
    stamp "engine A/B done (rc $?)"
    timeout ${SWEEP_S:-150} python3 tools/bench_expert_layer.py --sweep ${SWEEP:-small} --out "$OUT" \
      > "$OUT/bench_expert_layer.log" 2>&1
    stamp "sweep done (rc $?)"
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_engine.py -k expert_layer \
      > "$OUT/gpu_engine_expert_layer.log" 2>&1
    stamp "engine tests: $(tail -1 "$OUT/gpu_engine_expert_layer.log")"
    grep -E "^\|" "$OUT/ab_expert_layer.log"; grep -E "separate|persistent" "$OUT/bench_expert_layer.log" ;;
  retune)  # tune TUNE_GROUPS at TUNE_VIEWS x TUNE_PROMPTS (default: the 2-view shapes, which the tune stage above
    # never covered; TUNE_QUICK="" for the full ~100-candidate search), engine latency before/after in the same run
    V=${TUNE_VIEWS:-2}; P=${TUNE_PROMPTS:-0,20}; CASES=${BENCH_CASES:-"$V,0,63;$V,20,50"}
    if [ -n "${GPU_TESTS:-}" ]; then gpu_tests; fi
    if [ -z "${SKIP_BEFORE:-}" ]; then
      timeout 120 python3 -m vla_rt.cli bench --backends triton --cases "$CASES" --iters 200 --out "$OUT/before" \
        > "$OUT/bench_before.log" 2>&1
      stamp "before: $(grep median "$OUT/bench_before.log" | tr '\n' ' ')"
    fi
    tune_install_bench "${TUNE_GROUPS:-vlm,siglip,prefix_attention,siglip_attention}" "$V" "$P" "$CASES" \
      tune_log_retune.json ${TUNE_QUICK---quick} ;;
  streamk)  # Stream-K (config.tma 4): its GPU tests, then SK_GROUPS re-tuned at SK_VIEWS with Stream-K candidates
    # beside each incumbent (the table keeps whichever is faster), engine latency before/after in the same run
    timeout ${GPU_TESTS_S:-240} python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels_gpu.py \
      -k "stream_k or tma_gemm_bf16_wide" > "$OUT/gpu_tests_sk.log" 2>&1
    stamp "stream-K gpu tests: $(tail -1 "$OUT/gpu_tests_sk.log")"; grep -E "FAILED|Error" "$OUT/gpu_tests_sk.log" | head
    grep -q " passed" "$OUT/gpu_tests_sk.log" && ! grep -q "failed" "$OUT/gpu_tests_sk.log" || exit 1
    timeout 120 python3 tools/probe_stream_k.py --out "$OUT" > "$OUT/probe_stream_k.log" 2>&1
    stamp "probe (rc $?)"; cat "$OUT/probe_stream_k.log" | cut -c1-110
    CASES=${BENCH_CASES:-"1,0,63;3,0,63"}
    timeout 150 python3 -m vla_rt.cli bench --backends triton --cases "$CASES" --iters 200 --out "$OUT/before" \
      > "$OUT/bench_before.log" 2>&1
    stamp "before: $(grep median "$OUT/bench_before.log" | tr '\n' ' ')"
    TUNE_TMA=${TUNE_TMA:-4} TUNE_CANDIDATES=${TUNE_CANDIDATES:-8} tune_install_bench "${SK_GROUPS:-siglip,vlm}" \
      "${SK_VIEWS:-1,3}" "${SK_PROMPTS:-0}" "$CASES" tune_log_stream_k.json --quick ;;
  gluon)  # tools/gluon_skinny_gemm.py: the warp-specialized Gluon GEMM (weight ring filled before the PDL wait)
    # against the Triton gemm and cuBLAS in a 36-launch PDL chain; correctness first, each implementation under a timeout
    # (all implementations and chains take more than one call: GLUON_ONLY / GLUON_CHAINS pick, e.g. the expert MLP:
    # GLUON_CHAINS=mlp GLUON_ONLY=torch,triton,gluon-ws-n32k128s8-early-splitk4,gluon-ws-n64k128s4-early-splitk8)
    timeout 570 python3 tools/gluon_skinny_gemm.py --out "$OUT/gluon" ${GLUON_ONLY:+--only $GLUON_ONLY} \
      ${GLUON_CHAINS:+--chains $GLUON_CHAINS} > "$OUT/gluon.log" 2>&1
    stamp "gluon experiment (rc $?)"; tail -30 "$OUT/gluon.log" ;;
  skinny)  # triton_kernels/gluon_gemm.py: GPU tests (kernels, PDL chain in a graph, engine vs fp32), then the engine A/B
    timeout ${GPU_TESTS_S:-300} python3 -m pytest -q -x -p no:cacheprovider tests/test_gluon_gemm_gpu.py \
      > "$OUT/gpu_gluon_tests.log" 2>&1
    stamp "gluon gemm tests: $(tail -1 "$OUT/gpu_gluon_tests.log")"
    grep -E "FAILED|Error|assert" "$OUT/gpu_gluon_tests.log" | head -20
    timeout ${AB_S:-240} python3 tools/bench_fused.py --cases "${SKINNY_CASES:-1,0,63;3,0,63}" \
      --combos ${SKINNY_COMBOS:-off,default,skinny} --iters 100 --out "$OUT" > "$OUT/bench_fused.log" 2>&1
    stamp "engine A/B (rc $?)"; cat "$OUT"/fused_*.md 2>/dev/null || tail -20 "$OUT/bench_fused.log" ;;
  mlp)  # triton_kernels/gluon_mlp.py: kernel GPU tests, the engine with fused_mlp vs fp32, engine A/B, one step's profile
    # (MLP_TESTS=0 skips the kernel tests, for a timing-only call on a commit whose kernel already passed them;
    # MLP_ENGINE=0 stops after the probe)
    if [ "${MLP_TESTS:-1}" = 1 ]; then
      timeout ${GPU_TESTS_S:-200} python3 -m pytest -q -x -p no:cacheprovider tests/test_gluon_mlp_gpu.py \
        > "$OUT/gpu_mlp_tests.log" 2>&1
    else
      echo "skipped (MLP_TESTS=0), 0 passed" > "$OUT/gpu_mlp_tests.log"
    fi
    stamp "gluon mlp tests: $(tail -1 "$OUT/gpu_mlp_tests.log")"
    grep -E "FAILED|Error|assert" "$OUT/gpu_mlp_tests.log" | head -20
    if grep -q " passed" "$OUT/gpu_mlp_tests.log" && ! grep -q "failed" "$OUT/gpu_mlp_tests.log"; then
      timeout ${PROBE_S:-120} python3 tools/probe_mlp.py --out "$OUT" ${PROBE_CONFIGS:+--configs $PROBE_CONFIGS} \
        > "$OUT/probe_mlp.log" 2>&1
      stamp "probe (rc $?)"; grep -vE "^\||^#|^$" "$OUT/probe_mlp.log" | cut -c1-400
      [ "${MLP_ENGINE:-1}" = 1 ] || exit 0  # MLP_ENGINE=0: the kernel tests and the probe only
      timeout ${ENGINE_TESTS_S:-150} python3 -m pytest -q -x -p no:cacheprovider tests/test_gpu_engine.py -k fused_mlp \
        > "$OUT/gpu_engine_mlp_tests.log" 2>&1
      stamp "engine fused_mlp tests: $(tail -1 "$OUT/gpu_engine_mlp_tests.log")"
      timeout ${AB_S:-200} python3 tools/bench_fused.py --cases "${MLP_CASES:-1,0,63;3,0,63}" \
        --combos ${MLP_COMBOS:-default,mlp,mlp_o} --iters 100 --out "$OUT" > "$OUT/bench_fused.log" 2>&1
      stamp "engine A/B (rc $?)"; cat "$OUT"/fused_*.md 2>/dev/null || tail -20 "$OUT/bench_fused.log"
      timeout ${PROFILE_S:-100} python3 tools/profile_engine.py --case "${PROFILE_CASE:-1,0,63}" \
        --combos "${PROFILE_COMBOS:-default,mlp_o}" --out "$OUT" > "$OUT/profile.log" 2>&1
      stamp "profile (rc $?)"; grep -E "^==|layer:" "$OUT/profile.log" | cut -c1-140
    fi ;;
  profile)  # tools/profile_engine.py: one part's kernels (CUPTI) per PROFILE_COMBOS, PROFILE_CASES x PROFILE_PARTS
    for case in ${PROFILE_CASES:-1,0,63}; do for part in ${PROFILE_PARTS:-step}; do
      log="$OUT/profile_${part}_${case//,/_}.log"
      timeout ${PROFILE_S:-300} python3 tools/profile_engine.py --case "$case" --part "$part" \
        --combos "${PROFILE_COMBOS:-default,skinny}" --out "$OUT/$part/${case//,/_}" > "$log" 2>&1
      stamp "profile $part $case (rc $?)"; grep -E "^==|layer:|  x" "$log" | head -${PROFILE_LINES:-30} | cut -c1-140
    done; done ;;
  gpu_all)  # every -m gpu test in every test file that imports there (no hydra/omegaconf in the image); ~9 min
    timeout ${GPU_ALL_S:-560} python3 -m pytest -q -m gpu -p no:cacheprovider --continue-on-collection-errors -rf \
      tests/ > "$OUT/gpu_all.log" 2>&1
    stamp "gpu tests (all): $(tail -1 "$OUT/gpu_all.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_all.log" | head -20 ;;
  compile)  # one compile_row process a case (COMPILE_CASES, space-separated), each under COMPILE_BUDGET s, coordinate
    # descent COMPILE_CD=on|off; one inductor cache for all, so later cases reuse the GEMM autotuning of earlier ones.
    # COMPILE_WARM=1: first compile prefix_kv and velocity in two processes side by side (π0 cold: ~350 and ~280 s,
    # together over one call's 600 s), then time the row from the cache
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    for case in ${COMPILE_CASES:-1,0,63}; do
      name="compile_${case//,/_}_cd${COMPILE_CD:-on}"
      if [ "${COMPILE_WARM:-0}" = 1 ]; then
        for part in prefix_kv velocity; do
          timeout ${COMPILE_BUDGET:-300} python3 -m vla_rt.bench.compile_row --case "$case" --warm $part \
            --coordinate-descent ${COMPILE_CD:-on} > /dev/null 2> "$OUT/${name}_warm_$part.log" &
        done
        wait; stamp "warm-ups $case: $(grep -h -E '^warmed' "$OUT/${name}"_warm_*.log | tr '\n' ' ')"
      fi
      timeout ${COMPILE_BUDGET:-300} python3 -m vla_rt.bench.compile_row --case "$case" --iters 30 \
        --coordinate-descent ${COMPILE_CD:-on} > "$OUT/$name.json" 2> "$OUT/$name.log"
      stamp "compile $case cd ${COMPILE_CD:-on} (rc $?): $(grep -E '^compiled' "$OUT/$name.log" | tr '\n' ' ')"
      cut -c1-300 "$OUT/$name.json"
    done ;;
esac
