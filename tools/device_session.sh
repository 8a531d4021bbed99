#!/usr/bin/env bash
# The GPU check, in stages that each fit one device call (10 minutes): install, run the stage, logs under $OUT.
#   bash tools/device_session.sh tests      every GPU test under TESTS (default tests/: kernels, engines, streaming,
#                                           π0.5, CUDA expert, server; ~4-5 min)
#   bash tools/device_session.sh bench      the summaries benchmarks/results/ keeps: latency (triton, graphed torch;
#                                           BENCH_BACKENDS), streaming, the kernel table (~6 min)
#   bash tools/device_session.sh pi05       π0.5's triton latency (vla-rt bench --model pi05)
#   bash tools/device_session.sh accuracy   the Triton engine vs the float32 reference over DRAWS (100) random draws
#   bash tools/device_session.sh ab         tools/ab_actions.py on this tree (AB_CASES) and, with AB_OLD_DIR (an older
#                                           tree laid out as a package: vla_rt/ holding triton_kernels/, graph_passes/,
#                                           robot/), on that one, then --compare: actions bit for bit, latency
#   bash tools/device_session.sh load       the server's load test (LOAD_ROBOTS, LOAD_MAX_BATCH, LOAD_SECONDS)
#   bash tools/device_session.sh fleet      issue 26's fleet test: real openpi clients, π0 bf16, 2 views, prompt 20,
#                                           chunk 50, 10 Hz robots, rounds of FLEET_ROBOTS with admission (SLO
#                                           FLEET_SLO_MS; FLEET_SCHEDULER), then FLEET_COMPARE_SCHEDULERS (overlap,stage,batch:
#                                           stage-level against whole-batch)
#                                           at FLEET_COMPARE robots, each
#                                           server's start-up timed and bounded (FLEET_STARTUP_S); loadtest_*.json/.md/
#                                           .png under results/summaries (needs the wheels in .whl/, see below);
#                                           FLEET_FLAGS: more server flags, e.g. --batch-window-ms 2
#   bash tools/device_session.sh tune       re-tune the launch table (TUNE_GROUPS, TUNE_VIEWS, TUNE_PROMPTS,
#                                           TUNE_CHUNKS, TUNE_BATCHES, TUNE_BUDGET s), then time triton (TUNE_AFTER=
#                                           stages: the stage engine's costs instead)
#   bash tools/device_session.sh cublas     A/B of the GEMMs handed to cuBLAS where the table measured it faster
#                                           (triton_kernels/cublas_choice.py) against all Triton: latency of
#                                           CUBLAS_CASES and the stage costs, VLA_RT_GEMM_CUBLAS=off then auto
#   bash tools/device_session.sh handoff    issue 25: the floor of a persistent kernel's hand-offs, a chain of bare
#                                           stages by fan-in and bytes read (tools/handoff_probe.py, ~1 min)
#   bash tools/device_session.sh unit       issue 25: the floor of one B = 1 GEMM stage by tiling: today's 64 columns
#                                           over all K, or K split over a cluster of 2 / 4 reduced in DSMEM
#                                           (tools/unit_probe.py, ~1 min)
#   bash tools/device_session.sh attribution  issue 25: the persistent expert's protocol in parts (ATTR_TILINGS, diag
#                                           variants) beside the default and the per-op step, traced (~3 min;
#                                           ATTR_FLAGS=--write-choice: the winner's row, if any, into
#                                           $OUT/cuda_expert_choice_<GPU>.json for cuda_kernels/configs/<GPU>.json)
#   bash tools/device_session.sh expertcheck  issue 25: replay, broken hand-off and accuracy of the persistent expert
#                                           variant CHECK_TILING (tools/cuda_expert_check.sh; CASES, DRAWS; ~2 min)
#   bash tools/device_session.sh bisect     the Triton engine vs the float32 reference with cuBLAS off / on / per epilogue
#                                           kind and the float32 GEMMs on IEEE (tools/accuracy_bisect.py; DRAWS, ~3 min)
#   bash tools/device_session.sh stages     the serving stages' costs per bucket vs the roofline (tools/stage_costs.py)
#   bash tools/device_session.sh attention  the attention kernels vs SDPA's backends (tools/attention_probe.py,
#                                           PROBE_CONFIGS), the attention shapes re-tuned (server buckets, then the
#                                           1-robot call), the probe on the new table, the stage costs (~8 min)
#   bash tools/device_session.sh overlap    the expert steps beside a prefix stage, alone / overlapped / on green-context
#                                           SM partitions (tools/overlap_probe.py; OVERLAP_ARGS)
#   bash tools/device_session.sh partition  the stage tests, then the server without admission at PARTITION_ROBOTS robots
#                                           with PARTITION_SMS SMs kept for the expert steps (--expert-sms; 0: shared)
#   bash tools/device_session.sh variants   the server without admission under each of VARIANTS (server flag sets split
#                                           by ';', an empty one: the defaults; NAME=value words set the server's
#                                           environment) at VARIANT_ROBOTS robots, an A/B
#   bash tools/device_session.sh warmth     issue 26: the host's cold steps for a lone robot at 10 Hz and what warms them
#                                           (tools/host_warmth_probe.py, WARMTH_ARGS; ~25 s, no GPU)
#   bash tools/device_session.sh pi05rows   π0.5's modulation rows and attention lookup: their GPU tests, then π0.5's
#                                           stage costs and latency on this tree and on OLD_TREE (the tree before them,
#                                           carried; ~8 min)
#   bash tools/device_session.sh margin     issue 26: the one-robot margin, this tree against OLD_TREE (carried, laid out
#                                           as a package) after the transport floor (tools/transport_floor.py) and
#                                           the engine's own call for the shape (vla-rt bench 2,20,50; ~6 min)
#   bash tools/device_session.sh launch     issue 26: a stage graph's launch latency on an idle GPU, and the prefix as two
#                                           graphs (tools/graph_launch_probe.py, ~1 min)
#   bash tools/device_session.sh host       where a prefix stage's host time goes (tools/admit_host_probe.py, HOST_ARGS:
#                                           default the server's buckets, --max-batch 32 --max-prefix 8)
#   bash tools/device_session.sh fp32       the float32 GEMMs, ieee vs tf32x3, and their launch-table entries
#                                           (tools/fp32_gemm_precision.py --write-table; the table comes back in $OUT)
#   bash tools/device_session.sh ray        issue 29: the fleet over `vla-rt serve --ray` (RAY_REPLICAS replicas, one per
#                                           GPU by default; RAY_ROBOTS); Ray is not on the image and its wheel is over
#                                           the 64 MiB a call carries: `bash tools/ray_bundle.sh`, carry .raybundle
#   bash tools/device_session.sh profile    the kernels of the batched stages (PROFILE_SPECS "part:rows ...", PROFILE_CASE)
#   bash tools/device_session.sh ncu        Nsight Compute on one expert step's kernels (NCU_ROWS "1 8", NCU_COUNT,
#                                           NCU_PART step|vision|prefix; NCU_PERSISTENT: the persistent CUDA step's
#                                           tiling, JSON, at NCU_PERSISTENT_ROWS): a table a kernel (tools/ncu_summary.py)
#   bash tools/device_session.sh lerobot    the LeRobot plugin's select_action vs LeRobot's own (carry .whl_lerobot; since
#                                           the tree reached ~10 MB the wheels pass 64 MiB: first `lerobot_av` carrying
#                                           .whl_lerobot/av, then at once `lerobot` carrying .whl and .whl_lerobot/rest)
#   bash tools/device_session.sh compile    the torch.compile(max-autotune) row of the latency table (COMPILE_CASES)
#   bash tools/device_session.sh split      the split π0 (docs/split.md): tests/split's GPU tests, then the prefix server
#                                           and the robot-side expert as two processes (python -m vla_rt.bench.split;
#                                           needs the websockets wheel carried in .whl/, see below; SPLIT_ARGS, e.g.
#                                           "--device cuda:1 --prefix-device cuda:0" on two GPUs)
#   bash tools/device_session.sh all        PARTS (default "tests ab pi05 load"; any stages, e.g. "tests overlap")
#                                           in one call and one results.tgz, for a short budget
# Everything a stage writes goes into $OUT/results.tgz (the device returns at most 8 files) plus its short logs; the
# benchmark summaries are under results/summaries/, ready for benchmarks/results/.
# The GPU image lacks websockets, openpi-client (+ dm-tree), pyserial, omegaconf, antlr4, hydra-core and sentencepiece
# (a π0.5 server's tokenizer; `python tools/stand_in_tokenizer.py .tok/tokenizer.model` writes a stand-in) (`vla-rt
# bench` validates its config with omegaconf; the server needs websockets): carry them as wheels in .whl/ (git-ignored):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d .whl websockets openpi-client dm-tree \
#     pyserial omegaconf==2.3.0 hydra-core==1.3.2 msgpack prometheus-client sentencepiece \
#     && pip wheel --no-deps -w .whl antlr4-python3-runtime==4.9.3
# and pass carry=[".whl"]. The load test's server builds a Triton engine per batch bucket before the first round:
# give LOAD_S >= 300 (100 s was not enough for buckets 1..8 of full π0 on the H200).
set -uo pipefail
STAGE=${1:-tests}
FINAL_OUT=${OUT:-/tmp/out}; OUT=/tmp/results
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL_OUT"  # a warm machine keeps /tmp: no earlier stage's files in this archive
trap 'tar czf "$FINAL_OUT/results.tgz" -C /tmp results; cp "$OUT"/*.log "$FINAL_OUT"/ 2>/dev/null | head -0' EXIT
export PYTHONUNBUFFERED=1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
if ls .whl/*.whl > /dev/null 2>&1; then  # pyserial for the runtime (not in the GPU image)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . > "$OUT/install.log" 2>&1 || { cat "$OUT/install.log"; exit 1; }
(cd /tmp && python3 -c "import vla_rt.triton_kernels") >> "$OUT/install.log" 2>&1 \
  || echo "warning: vla_rt is not importable outside the checkout (python3: $(command -v python3)); see install.log"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,memory.used --format=csv > "$OUT/nvidia_smi.txt" 2>&1
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
stamp "installed"
SUM="$OUT/summaries"
# the launch table of the card this call got (configs/<name>.json, e.g. NVIDIA-H200 or NVIDIA-H100-80GB-HBM3): the
# tune parts start from it and write it, so an H100 that came for an H200 call never overwrites the H200's table
TABLE=$(python3 -c "import torch; print(torch.cuda.get_device_name().strip().replace(' ', '-'))")
# ----- the parts (each under its own timeout: a hung kernel must not eat the call) --------------------------------
run_tests() {
  timeout ${TESTS_S:-540} python3 -m pytest -q -s -m gpu -p no:cacheprovider -rf --continue-on-collection-errors \
    ${TESTS:-tests/} > "$OUT/gpu_tests.log" 2>&1
  local rc=$?  # the call's exit status is pytest's, not the grep's (which finds nothing when all passed)
  stamp "gpu tests (rc $rc): $(tail -1 "$OUT/gpu_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -20
  return $rc
}
ab_run() {  # ab_run <name> <tree laid out as a package>: actions + latency of the default engines
  PYTHONPATH="$2${PYTHONPATH:+:$PYTHONPATH}" timeout ${AB_S:-540} python3 tools/ab_actions.py \
    --out "$OUT/ab_$1" ${AB_CASES:+--cases "$AB_CASES"} > "$OUT/ab_$1.log" 2>&1
  stamp "ab $1 (rc $?)"; cut -c1-100 "$OUT/ab_$1.log" | grep median
}
run_ab() {  # this tree laid out as a package too, so neither side depends on the editable install
  rm -rf /tmp/ab_new && mkdir -p /tmp/ab_new && cp -r vla_rt /tmp/ab_new/
  for d in triton_kernels cuda_kernels graph_passes robot; do cp -r $d /tmp/ab_new/vla_rt/$d; done
  ab_run new /tmp/ab_new
  if [ -n "${AB_OLD_DIR:-}" ]; then
    ab_run old "$PWD/$AB_OLD_DIR"
    python3 tools/ab_actions.py --compare "$OUT/ab_old" "$OUT/ab_new" > "$OUT/ab_compare.md" 2>&1
    stamp "ab compare (rc $?)"; cat "$OUT/ab_compare.md"
  fi
}
run_pi05() {
  timeout ${BENCH_S:-300} python3 -m vla_rt.cli bench --model pi05 --backends ${BENCH_BACKENDS:-triton} --iters 50 \
    --out "$SUM" > "$OUT/latency_pi05.log" 2>&1
  stamp "bench pi05 (rc $?)"; grep -E "median" "$OUT/latency_pi05.log" | cut -c1-120
}
run_load() {
  timeout ${LOAD_S:-540} python3 -m vla_rt.cli loadtest random:pi0 --profile generic --num-views 2 --prompt-len 20 \
    --chunk 50 --max-batch ${LOAD_MAX_BATCH:-16} --robots ${LOAD_ROBOTS:-1,4,8,16,32} --rate 10 \
    --seconds ${LOAD_SECONDS:-5} --out "$SUM" > "$OUT/loadtest.log" 2>&1
  stamp "loadtest (rc $?)"; grep -E "^\|" "$OUT/loadtest.log" | tail -8
}
run_fleet() {  # three servers in one call: the main one (admission on), then stage and batch without admission
  # first the one-robot round trip with no model (tools/transport_floor.py, ~15 s): the part of the one-robot margin
  # that is websocket transport and decode on this host
  timeout 60 python3 tools/transport_floor.py --seconds 10 --json "$SUM/transport_floor.json" > "$OUT/transport_floor.log" 2>&1
  stamp "transport floor (rc $?)"; tail -1 "$OUT/transport_floor.log" | cut -c1-200
  timeout ${FLEET_S:-570} python3 -m vla_rt.cli loadtest ${FLEET_CKPT:-random:pi0} --profile generic --num-views 2 \
    --prompt-len 20 --chunk 50 --max-batch ${FLEET_MAX_BATCH:-32} --max-prefix ${FLEET_MAX_PREFIX:-8} \
    --scheduler ${FLEET_SCHEDULER:-overlap} --compare-schedulers ${FLEET_COMPARE_SCHEDULERS:-overlap,stage,batch} \
    --slo-ms ${FLEET_SLO_MS:-80} --robots ${FLEET_ROBOTS:-1,2,4,6,8,16,32,64} --compare ${FLEET_COMPARE:-8,16,32} \
    --rate 10 --seconds ${FLEET_SECONDS:-8} --cost-iters ${FLEET_COST_ITERS:-15} \
    --startup-timeout ${FLEET_STARTUP_S:-240} ${FLEET_FLAGS:-} --out "$SUM" > "$OUT/fleet.log" 2>&1
  stamp "fleet (rc $?)"; grep -E "healthy after|robots:|^wrote" "$OUT/fleet.log" | cut -c1-160
  grep -hE "^\||^One robot|^Server start-up" "$SUM"/loadtest_*.md 2>/dev/null | head -24 | cut -c1-400
  cp "$SUM"/server*.log "$OUT"/ 2>/dev/null; grep -h "cost model\|start-up" "$OUT"/server.log | cut -c1-160
}

run_variants() {  # run_variants <name> <robots> <seconds> <sets> [labels]: the server without admission under each
  # set (';' separated, empty: the defaults; NAME=value words are the server's environment, the rest its flags) ->
  # $SUM/<name>_<label> (labels: space separated, one a set; default 0, 1, ...)
  local name=$1 robots=$2 limit=$3 i=0 set word flags envs out
  IFS=';' read -ra SETS <<< "$4;"  # the ';' keeps a trailing empty set (the defaults) in the list
  read -ra LABELS <<< "${5:-}"
  for set in "${SETS[@]}"; do
    out=${name}_${LABELS[$i]:-$i}; envs=(); flags=""
    for word in $set; do [[ $word =~ ^[A-Z_]+= ]] && envs+=("$word") || flags+=" $word"; done
    timeout $limit env "${envs[@]}" python3 -m vla_rt.cli loadtest random:pi0 --profile generic --num-views 2 \
      --prompt-len 20 --chunk 50 --max-batch 32 --max-prefix 8 --no-admission ${flags# } --robots $robots \
      --rate 10 --seconds ${FLEET_SECONDS:-6} --cost-iters 10 --startup-timeout 150 --out "$SUM/$out" \
      > "$OUT/$out.log" 2>&1
    stamp "loadtest $out [${set:-defaults}] (rc $?)"; grep -hE "^\| [0-9]+ \|" "$SUM/$out"/loadtest_*.md | head -6
    grep -hE "^One robot" "$SUM/$out"/loadtest_*.md | cut -c1-300
    grep -h "cost model: prefix stage of [18] " "$SUM/$out"/server*.log 2>/dev/null | cut -c1-260
    i=$((i+1))
  done
}

run_stage() {  # one part; `all` runs several in one call, into one results.tgz
case "$1" in
  tests) run_tests ;;
  bench)
    timeout ${LATENCY_S:-300} python3 -m vla_rt.cli bench --backends ${BENCH_BACKENDS:-triton,cuda-graph-torch} \
      --iters 200 --out "$SUM" > "$OUT/latency.log" 2>&1
    stamp "latency (rc $?)"; grep -E "median" "$OUT/latency.log" | cut -c1-120
    timeout ${STREAMING_S:-150} python3 -m vla_rt.bench.streaming --views 1 2 3 --seconds 3 --out "$SUM" \
      > "$OUT/streaming.log" 2>&1
    stamp "streaming (rc $?)"; grep -E "^\|" "$OUT/streaming.log" | tail -3
    timeout ${KERNELS_S:-120} python3 -m vla_rt.bench.kernels --views 1,3 --prompts 0,20 --chunks 50,63 \
      --out "$SUM/kernels_$TABLE.json" > "$OUT/kernels.log" 2>&1
    stamp "kernel table (rc $?): $(grep -c '^gemm\|^attention' "$OUT/kernels.log") rows" ;;
  accuracy)
    timeout ${ACCURACY_S:-540} python3 -m vla_rt.bench.accuracy --draws ${DRAWS:-100} --out "$SUM" \
      > "$OUT/accuracy.log" 2>&1
    stamp "accuracy (rc $?)"; tail -4 "$OUT/accuracy.log" ;;
  ab) run_ab ;;
  split)
    timeout ${TESTS_S:-90} python3 -m pytest -q -s -m gpu -p no:cacheprovider -rf tests/split/test_split_gpu.py \
      > "$OUT/split_tests.log" 2>&1
    stamp "split gpu tests (rc $?): $(tail -1 "$OUT/split_tests.log")"
    timeout ${SPLIT_S:-420} python3 -m vla_rt.bench.split --out "$SUM" --log-dir "$OUT" ${SPLIT_ARGS:-} > "$OUT/split.log" 2>&1
    stamp "split bench (rc $?)"; grep -E "^\|" "$SUM"/split_*.md | cut -c1-220 ;;
  pi05) run_pi05 ;;
  load) run_load ;;
  fleet) run_fleet ;;
  tune)  # the table the engine reads; commit triton_kernels/configs/$TABLE.json from results/ if it is better
    # the server's batched shapes: TUNE_GROUPS=vlm,siglip TUNE_VIEWS=2 TUNE_PROMPTS=20 TUNE_CHUNKS=50 TUNE_BATCHES=8
    # TUNE_AFTER=stages (the stage engine's costs with the new table, tools/stage_costs.py, instead of vla-rt bench;
    # STAGES_ARGS, e.g. "--prefix-buckets 1 --expert-buckets 1 2 4 8");
    # TUNE_SEARCH="--max-candidates 60" searches wider than --quick's 20 (the batched attention gained 19% from it)
    timeout ${TUNE_S:-420} python3 -m vla_rt.triton_kernels.tuning ${TUNE_SEARCH:---quick} --groups ${TUNE_GROUPS:-expert,attention,vlm,siglip} \
      --views ${TUNE_VIEWS:-1,2,3} --prompts ${TUNE_PROMPTS:-0,20} --chunks ${TUNE_CHUNKS:-63,50} \
      --batches ${TUNE_BATCHES:-1} --budget-s ${TUNE_BUDGET:-360} --overlap \
      --out "$OUT/$TABLE.json" --log "$OUT/tune_log.json" > "$OUT/tune.log" 2>&1
    stamp "tune: $(tail -1 "$OUT/tune.log")"; cp "$OUT/$TABLE.json" "$FINAL_OUT/" 2>/dev/null
    cp "$OUT/$TABLE.json" "triton_kernels/configs/$TABLE.json"
    if [ "${TUNE_AFTER:-bench}" = stages ]; then
      timeout ${STAGES_S:-200} python3 tools/stage_costs.py --backends triton ${STAGES_ARGS:-} --out "$SUM" \
        > "$OUT/stages_after.log" 2>&1
      stamp "stage costs with the new table (rc $?)"; grep -E "^\| triton" "$OUT/stages_after.log"
    else
      timeout 120 python3 -m vla_rt.cli bench --backends triton --iters 200 --out "$OUT/after" > "$OUT/after.log" 2>&1
      stamp "triton with the new table: $(grep median "$OUT/after.log" | tr '\n' ' ' | cut -c1-400)"
    fi ;;
  fp32)  # the float32 GEMMs (openpi's float32 patch / suffix embeddings): ieee vs tf32x3, configs into the table
    timeout ${FP32_S:-150} python3 tools/fp32_gemm_precision.py --out "$SUM" --write-table > "$OUT/fp32.log" 2>&1
    stamp "fp32 gemms (rc $?)"; grep -E "^\|" "$OUT/fp32.log" | cut -c1-170
    cp "triton_kernels/configs/$TABLE.json" "$FINAL_OUT/" ;;
  partition)  # the server with SMs kept for the expert steps (--expert-sms) against all shared, no admission
    timeout ${TESTS_S:-150} python3 -m pytest -q -s -m gpu -p no:cacheprovider -rf tests/test_gpu_stages.py \
      > "$OUT/partition_tests.log" 2>&1
    stamp "stage tests (rc $?): $(tail -1 "$OUT/partition_tests.log")"; grep -E "^(FAILED|ERROR)" "$OUT/partition_tests.log"
    sets=""; for sms in ${PARTITION_SMS:-0 32 16}; do sets+="${sets:+;}--expert-sms $sms"; done
    run_variants partition "${PARTITION_ROBOTS:-1,4,8,16,32}" ${PARTITION_S:-170} "$sets" "${PARTITION_SMS:-0 32 16}" ;;
  variants)  # the server without admission under each of VARIANTS (flag sets split by ';'; NAME=value: environment)
    run_variants variant "${VARIANT_ROBOTS:-1,8,16,32}" ${VARIANT_S:-170} "${VARIANTS:-;OMP_NUM_THREADS=1}" ;;
  warmth)  # issue 26: a lone robot's host steps at 10 Hz, plain / after a busy spin / after a dry run (no GPU)
    timeout ${WARMTH_S:-90} python3 tools/host_warmth_probe.py ${WARMTH_ARGS:-} > "$OUT/warmth.log" 2>&1
    stamp "host warmth probe (rc $?)"; cat "$OUT/warmth.log" ;;
  pi05rows)  # π0.5's modulation rows in the kernels: their GPU tests, then π0.5's stage costs here and on OLD_TREE
    # (the tree before them, e.g. `git archive <commit> | tar -x -C .old_tree`, carried) in the same call
    timeout ${TESTS_S:-200} python3 -m pytest -q -s -p no:cacheprovider -rf tests/test_kernels_gemm_pi05.py \
      tests/test_gpu_stages.py tests/test_gpu_pi05.py > "$OUT/pi05rows_tests.log" 2>&1
    stamp "π0.5 rows tests (rc $?): $(tail -1 "$OUT/pi05rows_tests.log")"
    for tree in "$PWD" "$PWD/${OLD_TREE:-.old_tree}"; do
      [ -d "$tree/vla_rt" ] || { echo "no tree at $tree (OLD_TREE)"; continue; }
      (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout ${STAGES_S:-150} python3 tools/stage_costs.py \
        --checkpoint random:pi05 --backends triton --expert-buckets 1 8 16 32 --prefix-buckets 1 --iters 5) \
        > "$OUT/stages_pi05_$(basename "$tree").log" 2>&1
      stamp "π0.5 stage costs at $tree (rc $?)"; grep -E "^\| triton" "$OUT/stages_pi05_$(basename "$tree").log"
      (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout ${BENCH_S:-150} python3 -m vla_rt.cli bench --model pi05 \
        --backends triton --iters 50 --out "$OUT/bench_pi05_$(basename "$tree")") > "$OUT/latency_pi05_$(basename "$tree").log" 2>&1
      stamp "π0.5 latency at $tree (rc $?)"; grep -E "median" "$OUT/latency_pi05_$(basename "$tree").log" | cut -c1-120
    done ;;
  margin)  # issue 26's one-robot margin, A/B on one warm machine: the transport floor (no model), then one robot
    # against this tree's server and OLD_TREE's, MARGIN_ROUNDS times, alternating. OLD_TREE laid out as a package
    # (carried): git archive 5562bae | tar -x -C .old_tree; for d in triton_kernels cuda_kernels graph_passes robot;
    # do mv .old_tree/$d .old_tree/vla_rt/; done
    timeout 60 python3 tools/transport_floor.py --seconds 10 --json "$SUM/transport_floor.json" > "$OUT/transport_floor.log" 2>&1
    stamp "transport floor (rc $?)"; tail -1 "$OUT/transport_floor.log" | cut -c1-200
    # the engine's own call for the fleet's shape (what issue 26 measures the margin against), same machine
    timeout ${MARGIN_BENCH_S:-150} python3 -m vla_rt.cli bench --backends triton --iters 100 --cases "2,20,50" \
      --out "$SUM/engine_call" > "$OUT/engine_call.log" 2>&1
    stamp "engine call (rc $?)"; grep -hE "^\| [0-9] view" "$SUM/engine_call"/latency_*.md | cut -c1-200
    for round in $(seq ${MARGIN_ROUNDS:-1}); do
      for tree in "$PWD" "$PWD/${OLD_TREE:-.old_tree}"; do
        [ -d "$tree/vla_rt" ] || { echo "no tree at $tree (OLD_TREE)"; continue; }
        name=margin_$(basename "$tree")_$round
        (cd "$tree" && PYTHONPATH="$tree:${PYTHONPATH:-}" timeout ${MARGIN_S:-170} python3 -m vla_rt.cli loadtest random:pi0 \
          --profile generic --num-views 2 --prompt-len 20 --chunk 50 --max-batch 32 --max-prefix 8 --robots 1 --rate 10 \
          --seconds ${MARGIN_SECONDS:-10} --cost-iters 10 --startup-timeout 160 --out "$SUM/$name") > "$OUT/$name.log" 2>&1
        stamp "one robot, $(basename "$tree"), round $round (rc $?)"; grep -h "^One robot" "$SUM/$name"/loadtest_*.md | cut -c1-420
      done
    done ;;
  launch)  # issue 26: what a CUDA Graph's launch costs a stage that starts on an idle GPU (a lone robot's prefix)
    timeout ${LAUNCH_S:-150} python3 tools/graph_launch_probe.py --out "$SUM" > "$OUT/graph_launch.log" 2>&1
    stamp "graph launch probe (rc $?)"; grep -E "^\|" "$OUT/graph_launch.log" ;;
  host)  # where a prefix stage's host time goes: admit alone, then the server's buckets and cost model (HOST_ARGS)
    timeout ${HOST_S:-240} python3 tools/admit_host_probe.py ${HOST_ARGS:---max-batch 32 --max-prefix 8} \
      > "$OUT/admit_host.log" 2>&1
    stamp "admit host probe (rc $?)"; grep -E "admit returned|cost model: prefix|host part|CPU threads" "$OUT/admit_host.log" | cut -c1-330 ;;
  overlap)  # a prefix stage beside the expert steps: how much it slows them, and SM partitions (green contexts)
    timeout ${OVERLAP_S:-240} python3 tools/overlap_probe.py ${OVERLAP_ARGS:-} --out "$SUM" > "$OUT/overlap.log" 2>&1
    stamp "overlap probe (rc $?)"; grep -E "^\|" "$OUT/overlap.log" | cut -c1-220 ;;
  cublas)  # A/B: the GEMMs the table measured faster on cuBLAS handed to it (triton_kernels/cublas_choice.py) vs all
    # Triton (VLA_RT_GEMM_CUBLAS=off): the latency of CUBLAS_CASES, then the serving stages' costs
    for mode in off auto; do
      VLA_RT_GEMM_CUBLAS=$mode timeout ${CUBLAS_BENCH_S:-150} python3 -m vla_rt.cli bench --backends triton --iters 100 \
        --cases "${CUBLAS_CASES:-2,20,50;1,0,63}" --out "$SUM/cublas_$mode" > "$OUT/cublas_bench_$mode.log" 2>&1
      stamp "bench, cuBLAS $mode (rc $?)"; grep -hE "^\| [0-9] view" "$SUM/cublas_$mode"/latency_*.md | cut -c1-200
      VLA_RT_GEMM_CUBLAS=$mode timeout ${CUBLAS_STAGES_S:-120} python3 tools/stage_costs.py --backends triton \
        --prefix-buckets 1 8 --expert-buckets 1 32 --iters 10 --out "$SUM/cublas_stages_$mode" \
        > "$OUT/cublas_stages_$mode.log" 2>&1
      stamp "stage costs, cuBLAS $mode (rc $?)"; grep -E "^\|" "$OUT/cublas_stages_$mode.log" | cut -c1-200
    done ;;
  handoff)  # issue 25: what a bare hand-off costs a stage (tools/handoff_probe.py), by fan-in and bytes read
    timeout ${HANDOFF_S:-120} python3 tools/handoff_probe.py ${HANDOFF_ARGS:-} --out "$SUM" > "$OUT/handoff.log" 2>&1
    stamp "handoff probe (rc $?)"; grep -E "^\||CTAs" "$OUT/handoff.log" ;;
  unit)  # issue 25: the floor of one GEMM stage by tiling, K split over clusters or not, and of the attention and merge
    # units (tools/unit_probe.py)
    timeout ${UNIT_S:-150} python3 tools/unit_probe.py ${UNIT_ARGS:-} --out "$SUM" > "$OUT/unit.log" 2>&1
    stamp "unit probe (rc $?)"; grep -E "^\||SMs|^c1 in parts|^one bulk|^two chains|^an attention|^a merge|^m64n64" "$OUT/unit.log" | cut -c1-200 ;;
  attribution)  # issue 25: where the persistent expert's protocol spends a stage (ATTR_TILINGS: diag 3 = no copies
    # or MMAs, 7 = nor output stores, 4 = no output stores), beside the default kernel and the per-op step, traced
    OUT="$OUT" timeout ${ATTR_S:-300} python3 tools/cuda_expert_check.py bench --cases 1 --sm-list 132 --trace-all \
      --reps 20 --tilings "${ATTR_TILINGS:-diag=3;diag=7;diag=4}" ${ATTR_FLAGS:-} > "$OUT/attribution.log" 2>&1
    stamp "attribution (rc $?)"; grep -vE "^\s*$" "$OUT/attribution.log" | tail -30 | cut -c1-220 ;;
  bisect)  # which GEMMs cost the Triton engine accuracy: cuBLAS off / on / per epilogue kind, fp32 on IEEE
    timeout ${BISECT_S:-240} python3 tools/accuracy_bisect.py --draws ${DRAWS:-20} ${BISECT_ARGS:-} --out "$SUM" \
      > "$OUT/bisect.log" 2>&1
    stamp "accuracy bisect (rc $?)"; grep -E "median" "$OUT/bisect.log" | cut -c1-200 ;;
  expertcheck)  # issue 25: a persistent-expert variant's correctness (CHECK_TILING, e.g. acc_chains=2):
    # tools/cuda_expert_check.sh's CHECK_STAGES (default replay, broken, accuracy over CASES / DRAWS)
    OUT="$OUT/expert_check" STAGES="${CHECK_STAGES:-replay broken accuracy}" TILING="${CHECK_TILING:-}" \
      timeout ${CHECK_S:-300} bash tools/cuda_expert_check.sh > "$OUT/expert_check.log" 2>&1
    stamp "expert check ${CHECK_TILING:-default} (rc $?)"; grep -E "^==|^\{" "$OUT/expert_check.log" | cut -c1-240 ;;
  attention)  # the TMA attention kernel, in ATTN_PARTS (default all five): probe (ours vs SDPA's backends,
    # PROBE_CONFIGS beside the table's); server (the attention shapes re-tuned with the TMA kernel among the
    # candidates: the server's buckets at 2 views / prompt 20 / chunk 50); call (the 1-robot call's 1/2/3 views at
    # prompt 0 / chunk 63); after (the probe on the new table); stages (the stage costs, STAGES_ARGS). The table
    # comes back in $OUT: commit it if it is better. ATTN_BATCHES / ATTN_TUNE_S / ATTN_BUDGET (default the TUNE_ ones)
    # keep these tunes apart from a `tune` part's in the same call.
    has() { [[ " ${ATTN_PARTS:-probe server call after stages} " == *" $1 "* ]]; }
    if has probe; then
      timeout ${PROBE_S:-150} python3 tools/attention_probe.py --configs "${PROBE_CONFIGS:-}" \
        --out "$SUM/attention_probe_before.json" > "$OUT/attention_probe_before.log" 2>&1
      stamp "attention probe (rc $?)"; grep -E "ours|sdpa" "$OUT/attention_probe_before.log" | grep -v "not available" | cut -c1-130
    fi
    for which in server call; do
      has $which || continue
      if [ $which = server ]; then args="--views 2 --prompts 20 --chunks 50 --batches ${ATTN_BATCHES:-${TUNE_BATCHES:-1,2,4,8,16,32}}"
      else args="--views 1,2,3 --prompts 0 --chunks 63 --batches 1"; fi
      timeout ${ATTN_TUNE_S:-${TUNE_S:-200}} python3 -m vla_rt.triton_kernels.tuning ${TUNE_SEARCH:---quick} \
        --groups ${ATTN_GROUPS:-expert_attention,prefix_attention,siglip_attention} $args \
        --budget-s ${ATTN_BUDGET:-${TUNE_BUDGET:-170}} --overlap \
        --out "$OUT/$TABLE.json" --log "$OUT/tune_log_$which.json" > "$OUT/tune_$which.log" 2>&1
      stamp "tune $which shapes (rc $?): $(tail -1 "$OUT/tune_$which.log")"
      grep -h " us (" "$OUT/tune_$which.log" | cut -c12-160
      cp "$OUT/$TABLE.json" "triton_kernels/configs/$TABLE.json"; cp "$OUT/$TABLE.json" "$FINAL_OUT/"
    done
    if has after; then
      timeout ${PROBE_S:-150} python3 tools/attention_probe.py --out "$SUM/attention_probe_after.json" \
        > "$OUT/attention_probe_after.log" 2>&1
      stamp "attention probe on the new table (rc $?)"; grep -E "ours" "$OUT/attention_probe_after.log" | cut -c1-130
    fi
    if has stages; then
      timeout ${STAGES_S:-200} python3 tools/stage_costs.py --backends triton ${STAGES_ARGS:-} --out "$SUM" \
        > "$OUT/stages.log" 2>&1
      stamp "stage costs with the new table (rc $?)"; grep -E "^\| triton" "$OUT/stages.log"
    fi ;;
  stages)  # the serving stage engine's prefix / expert stage costs per bucket against the roofline (STAGES_BACKENDS,
    # STAGES_ARGS e.g. "--prefix-buckets 1 8 --expert-buckets 1 32")
    timeout ${STAGES_S:-300} python3 tools/stage_costs.py --backends ${STAGES_BACKENDS:-triton folded} ${STAGES_ARGS:-} --out "$SUM" \
      > "$OUT/stages.log" 2>&1
    stamp "stage costs (rc $?)"; grep -E "^\|" "$OUT/stages.log" ;;
  ray)  # issue 29: the fleet over `vla-rt serve --ray` (RAY_REPLICAS, default one per GPU); carry .raybundle (below)
    if ls .raybundle/ray-serve-*.tar.xz > /dev/null 2>&1; then
      mkdir -p /tmp/site && tar xJf .raybundle/ray-serve-*.tar.xz -C /tmp/site && export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    python3 -c "import ray, ray.serve; print('ray', ray.__version__)" || { echo "no Ray: bash tools/ray_bundle.sh, carry .raybundle"; exit 2; }
    port=${RAY_PORT:-8000}
    python3 -m vla_rt.cli serve ${RAY_CKPT:-random:pi0} --ray ${RAY_REPLICAS:+--replicas $RAY_REPLICAS} --port $port \
      --profile generic --num-views 2 --prompt-len 20 --chunk 50 --max-batch ${FLEET_MAX_BATCH:-32} \
      --max-prefix ${FLEET_MAX_PREFIX:-8} --slo-ms ${FLEET_SLO_MS:-80} ${RAY_SERVE_FLAGS:-} > "$OUT/ray_server.log" 2>&1 &
    server=$!
    # `vla-rt loadtest` without a checkpoint loads a server that is up: wait for its health check first
    healthy() { python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$port/healthz', timeout=2)" 2>/dev/null; }
    for _ in $(seq ${RAY_STARTUP_S:-300}); do
      healthy && break
      kill -0 $server 2>/dev/null || break
      sleep 1
    done
    stamp "ray server: $(healthy && echo healthy || echo "not healthy: see ray_server.log")"
    timeout ${RAY_S:-540} python3 -m vla_rt.cli loadtest --host 127.0.0.1 --port $port \
      --robots ${RAY_ROBOTS:-1,8,16,32,48,64,96,128} --rate 10 --seconds ${FLEET_SECONDS:-8} \
      --out "$SUM" > "$OUT/ray_fleet.log" 2>&1
    stamp "ray fleet (rc $?)"; grep -hE "^\|" "$SUM"/loadtest_*.md 2>/dev/null | head -14 | cut -c1-300
    kill -INT $server 2>/dev/null; timeout 60 tail --pid=$server -f /dev/null; kill -9 $server 2>/dev/null
    grep -h "replica\|Ray Serve" "$OUT/ray_server.log" | tail -5 | cut -c1-200 ;;
  profile)  # where the server's batched stages spend their time: kernels of one replay (tools/profile_engine.py)
    for spec in ${PROFILE_SPECS:-prefix:8 vision:8 step:32 step:1}; do
      part=${spec%%:*}; rows=${spec##*:}
      timeout ${PROFILE_S:-150} python3 tools/profile_engine.py --case ${PROFILE_CASE:-2,20,50} --part $part \
        --batch $rows --out "$SUM" > "$OUT/profile_${part}_b$rows.log" 2>&1
      stamp "profile $part at $rows rows (rc $?)"; head -14 "$OUT/profile_${part}_b$rows.log" | cut -c1-150
    done ;;
  ncu)  # issue 25's evidence: Nsight Compute on one expert step's kernels at NCU_ROWS rows (default "1 8"), each
    # kernel timed alone with its counters (profile_engine.py --ncu: one graph replay in the profiler window; the
    # first NCU_COUNT kernels of it, ~2 layers by default); the .ncu-rep files come back for the GUI. NCU_PERSISTENT
    # (a tiling, JSON, e.g. '{"acc_chains": 2}'): the persistent CUDA step too, at NCU_PERSISTENT_ROWS (default 1) and
    # NCU_PERSISTENT_CASE (default 1,0,63: issue 25's shape; the later --case wins)
    ncu_run() {  # $1 rows, $2 name, then profile_engine's extra arguments
      local rows=$1 name=$2; shift 2
      local rep="$OUT/ncu_${name}_b$rows"
      timeout ${NCU_S:-240} ncu --profile-from-start off --graph-profiling node --target-processes all \
        --launch-count ${NCU_COUNT:-24} --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy \
        --section LaunchStats --section SchedulerStats --section WarpStateStats -f -o "$rep" \
        python3 tools/profile_engine.py --ncu --case ${NCU_CASE:-2,20,50} --batch $rows "$@" \
        > "$OUT/ncu_${name}_b$rows.log" 2>&1
      stamp "ncu $name at $rows rows (rc $?)"; grep -E "^==ERROR|^==WARNING|Error" "$OUT/ncu_${name}_b$rows.log" | head -3
      ncu --import "$rep.ncu-rep" --csv --page raw > "$rep.csv" 2>> "$OUT/ncu_${name}_b$rows.log" \
        && python3 tools/ncu_summary.py "$rep.csv" > "$rep.md" 2>&1; cut -c1-260 "$rep.md"
    }
    for rows in ${NCU_ROWS:-1 8}; do
      ncu_run $rows ${NCU_PART:-step} --part ${NCU_PART:-step}
    done
    if [ -n "${NCU_PERSISTENT:-}" ]; then
      for rows in ${NCU_PERSISTENT_ROWS:-1}; do
        ncu_run $rows persistent --part step --persistent "$NCU_PERSISTENT" --case ${NCU_PERSISTENT_CASE:-1,0,63}
      done
    fi ;;
  lerobot_av)  # the first of two calls on one warm machine: av's 40 MB wheel alone (carry .whl_lerobot/av), into
    # /tmp/site, which the next call keeps; the tree (~10 MB) with every wheel would pass a call's 64 MiB
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      .whl_lerobot/av/*.whl > "$OUT/lerobot_pip.log" 2>&1 || { tail -3 "$OUT/lerobot_pip.log"; exit 1; }
    stamp "av installed in /tmp/site: call the lerobot stage next, within the machine's idle release" ;;
  lerobot)  # issue 28's latency: needs .whl_lerobot/ (docs/lerobot.md lists the wheels) carried beside .whl/, or
    # .whl_lerobot/rest after a lerobot_av call on the same warm machine
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
      $(ls .whl_lerobot/*.whl .whl_lerobot/rest/*.whl 2>/dev/null) > "$OUT/lerobot_pip.log" 2>&1 \
      || { tail -3 "$OUT/lerobot_pip.log"; exit 1; }
    python3 -c "import sys; sys.path.insert(0, '/tmp/site'); import av" 2>/dev/null \
      || { echo "av is not installed: carry it in .whl_lerobot/, or run the lerobot_av stage first"; exit 1; }
    PYTHONPATH="/tmp/site:$PWD" timeout ${LEROBOT_S:-480} python3 benchmarks/lerobot_latency.py --out "$SUM" \
      > "$OUT/lerobot.log" 2>&1
    stamp "lerobot latency (rc $?)"; grep -E "^\| pi" "$SUM"/lerobot_latency_*.md ;;
  compile)  # one compile_row process a case, each under COMPILE_BUDGET s; the two parts warmed side by side first
    # into one inductor cache (π0 cold: ~350 and ~280 s, together over one call), then the row timed from the cache
    export TORCHINDUCTOR_CACHE_DIR=/tmp/inductor_cache
    for case in ${COMPILE_CASES:-1,0,63}; do
      name="compile_${case//,/_}"
      for part in prefix_kv velocity; do
        timeout ${COMPILE_BUDGET:-420} python3 -m vla_rt.bench.compile_row --case "$case" --warm $part \
          --coordinate-descent ${COMPILE_CD:-off} > /dev/null 2> "$OUT/${name}_warm_$part.log" &
      done
      wait; stamp "warm-ups $case: $(grep -h -E '^warmed' "$OUT/${name}"_warm_*.log | tr '\n' ' ')"
      timeout ${COMPILE_BUDGET:-420} python3 -m vla_rt.bench.compile_row --case "$case" --iters 30 \
        --coordinate-descent ${COMPILE_CD:-off} > "$OUT/$name.json" 2> "$OUT/$name.log"
      stamp "compile $case (rc $?): $(grep -E '^compiled' "$OUT/$name.log" | tr '\n' ' ')"; cut -c1-300 "$OUT/$name.json"
    done ;;
  all)  # shorter part limits unless given: the whole call must fit the device's 10 minutes
    : ${TESTS_S:=240} ${AB_S:=100} ${BENCH_S:=90} ${LOAD_S:=160}
    for part in ${PARTS:-tests ab pi05 load}; do
      case "$part" in
        tests|ab|pi05|load) run_$part ;;
        all) echo "PARTS: all is not a part"; exit 2 ;;
        *) run_stage "$part" ;;  # any other stage, e.g. PARTS="tests overlap"
      esac
    done ;;
  *) echo "unknown stage $1: tests, bench, cublas, handoff, attribution, expertcheck, bisect, pi05, accuracy, ab, load, fleet, split, tune, attention, stages, overlap, partition, variants, pi05rows, launch, host, warmth, fp32, profile, ray, lerobot_av, lerobot, compile or all"; exit 2 ;;
esac
}
run_stage "$STAGE"
