#!/usr/bin/env bash
# The Llama block work on a Hopper machine (each stage bounded in time):
#   scripts/gpu_block.sh OUTDIR STAGE...      stages: build export tests train bench
# Each device call first sources scripts/device_env.sh (the peers' wheels and the prebuilt kernels; it
# says how to make them again on the build machine).
#   build   the block's kernels: default configs (bf16, fp16) and the tuning candidates (bf16), in
#           parallel; kernels found on $CODA_CUTLASS_PREBUILT_PATH are not rebuilt
#   export  the kernel cache as prebuilt kernels, xz-compressed into OUTDIR (to carry to a later run)
#   tests   tests/gpu/test_nn_gpu.py;  train  examples/train_llama.py;  bench  bench/block.py $BENCH_ARGS
#   suite   tests/gpu/test_kernels.py without the tests that build every candidate configuration
#   sustained  small bench/pairwise.py and bench/run.py runs (shuffled and sustained figures side by side)
#   rowreduce  tests/gpu/test_kernels.py + test_fp8_gpu.py for the programs with per-row reductions (28th session's
#              column-checked node: partial tiles included; every kernel prebuilt in .ab4)
#   fp8tests  the GPU tests of the FP8 blocks, the nn modules and the Hugging Face models
#   fp8block  bench/block.py, 8B widths, M = 8192: the FP8 recipes with bf16 torch.compile and torchao peers
#             (head-major attention inputs were timed here in the 30th session and lost: bench/block.py
#             --attention-inputs times them again)
#   fp8model  bench/model.py's FP8 rows (1B and 8B widths) beside Liger and coda bf16
#   probe     bench/probes/epilogue_outputs.py: the FP8 epilogue variants of docs/RESULTS.md (24th session); since the
#             28th session "(full checks)" is CUTLASS's row reduction, the library's before (same bits expected)
#   stepprofile  bench/probes/model_step_profile.py: 1B whole-model steps, wall against kernel time (26th session)
#   modelcompile  bench/model.py ($MODEL_CONFIGS, default 1b): coda, coda under torch.compile ($COMPILE_MODE), Liger,
#                 HF + compile ($MODEL_VARIANTS; at 3B widths four model copies need an H200's memory)
#   attention  bench/probes/attention_layouts.py at 8B and 1B widths: does coda's attention call (views of the QKV
#              output) cost ~0.3 ms a block against separate q, k, v (27th session); forced SDPA backends; the
#              same call under torch.compile
#   attentionmodel  the 1B bf16 model with each attention input form (bench/model.py coda@heads, coda@heads_repeated)
#   copies    stepprofile's figures for "tensorwise" at 1B and 8B widths with the compiled weight copies a call a block,
#             8 blocks to a call, and that with the amax folds together (tensorwise.py copies_blocks_per_call, folds_together; 31st session: the map kernel's
#             copies cost less device time but 30 ms of host time a step against 18, the step is host-bound)
#   hostprofile  stepprofile's figures for coda bf16 and "tensorwise" with cProfile's 45 functions of most host time
#                (27th session: the 1B "tensorwise" step is host-bound, 137 ms wall against 109 of kernels)
# A 30-minute device session (35th session's plan for the next; the 35th had an H100 for five calls after ten
# failed or refused ones, no H200), calls each under 10 minutes, back to back (a machine idle 30 s is given back):
# 1. on the H200, fp8block (8B, M = 8192: the H200's last 8B FP8 figures are the 30th session's) and the GPU tests
# not run since the 33rd/34th sessions on an H200; 2. on the H200, BENCH_ARGS "--widths 8b --tokens 16384 --fp8
# tensorwise blockwise_g16 --tune ..." (M = 16384 runs the 8192 plans: weight gradients up to 1.67x cuBLAS on an
# H100 in the 35th) and ship the plans it stores (coda_cutlass/nn/plans/h200.json); 3. 70B blockwise_g16 + torchao
# rowwise at M = 8192 on the H200; 4. the two-rank amax test over NCCL if a 2-GPU kind is lent.
# the GPU catalogue's cases whose kernels hold a per-row partial reduction (coda::ColumnCheckedRowReduction,
# 28th session), at its partial-tile shapes (M = 1000, N = 776; 129 x 136) among others
ROW_REDUCE_CASES="residual_norm_stats or row_max_min or total_sum or total_max_min or many_reductions or reductions_only \
or lse_partials or fp16_bias_relu or every_op or kn_accumulate_no_d or partials_norm_stats or small_tile_config \
or pair_generic or lm_head_lse_gather or lm_head_logits_i32 or lm_head_lse_partials or swiglu_backward \
or segment_sum_heads or segment_sum_narrow or segment_sum_wide or norm_stats_tensor or norm_stats_block or swiglu_row"
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:?OUTDIR}; shift
mkdir -p "$out"
export PYTHONUNBUFFERED=1
run() { local name=$1 limit=$2; shift 2; echo "== $name"; timeout "$limit" "$@" > "$out/$name.log" 2>&1; echo "rc=$?"; tail -n 30 "$out/$name.log"; }
for s in "$@"; do
  case "$s" in
    build) run build 480 python3 -c '
import sys, torch
sys.path.insert(0, "bench")
import coda_cutlass as cc
from coda_cutlass import epilogues as E
from block_kernels import BENCH
cc.compile_many(BENCH, skip_failed=True)
for dt in (torch.bfloat16, torch.float16):
    for p in (E.norm_stats, E.rope_backward):
        cc.compile_map(p, dt, verbose=False)' ;;
    export) mkdir -p /tmp/prebuilt-export && python3 -m coda_cutlass cache --export /tmp/prebuilt-export | tail -n 2
            (cd /tmp/prebuilt-export && ls | split -n l/2 - /tmp/part. && for p in /tmp/part.*; do
               tar -cf - -T "$p" | xz -T16 -6 > "$out/prebuilt-$(basename "$p").tar.xz"; done); ls -la "$out"/prebuilt-* ;;
    tests) run tests 300 python3 -m pytest -q -p no:logging tests/gpu/test_nn_gpu.py ;;
    train) run train ${TRAIN_LIMIT:-240} python3 examples/train_llama.py --out "$out/train" ;;
    bench) run bench ${BENCH_LIMIT:-560} python3 bench/block.py --out "$out/bench" ${BENCH_ARGS:-} ;;
    suite) run suite ${SUITE_LIMIT:-240} python3 -m pytest -q -p no:logging tests/gpu/test_kernels.py \
             -k "not every_candidate and not autotuner" ;;
    sustained) run pairwise 90 python3 bench/pairwise.py --m 8192 --workloads swiglu rope --no-tune --rounds 3 \
                 --out "$out/pairwise"
               run run 90 python3 bench/run.py --m 8192 --epilogues norm_stats --shapes out-proj gate/up --no-tune \
                 --rounds 3 --out "$out/run" ;;
    rowreduce) run rowreduce ${TESTS_LIMIT:-400} python3 -m pytest -q -p no:logging tests/gpu/test_kernels.py \
                 tests/gpu/test_fp8_gpu.py -k "(matches_reference or bitwise_deterministic) and ($ROW_REDUCE_CASES)" ;;
    fp8tests) run fp8tests ${TESTS_LIMIT:-560} python3 -m pytest -q -p no:logging --durations=15 tests/gpu/test_fp8_block_gpu.py \
                tests/gpu/test_nn_gpu.py tests/gpu/test_nn_modules_gpu.py tests/gpu/test_hf_gpu.py ;;
    fp8block) run fp8block ${BENCH_LIMIT:-560} python3 bench/block.py --widths 8b --tokens 8192 \
                --fp8 tensorwise blockwise_g16 \
                --skip coda coda-identity eager liger --no-max-autotune \
                --energy-seconds 0 --rounds 4 --out "$out/fp8block" ;;
    fp8model) run fp8model ${MODEL_LIMIT:-560} python3 bench/model.py --configs 1b,8b \
                --variants liger,coda,coda-fp8-tensorwise,coda-fp8-blockwise_g16 --out "$out/fp8model" ;;
    probe) run probe ${PROBE_LIMIT:-560} python3 bench/probes/epilogue_outputs.py "$out/probe" \
             --sites down_dgrad gate_up o down --only "tensor coop identity" "tensor coop swiglu_backward_t" \
             "tensor identity" "tensor swiglu_backward_t" "tensor e64x16 identity" "tensor e64x16 swiglu_backward_t" \
             "tensor 64x128 identity" "tensor 64x128 swiglu_backward_t" "tensor 128x64 identity" \
             "tensor 128x64 swiglu_backward_t" "tensor swiglu_backward_t_one_amax" \
             "tensor coop swiglu_backward_t_one_amax" "tensor swiglu_backward_t (full checks)" \
             "tensor coop swiglu_backward_t (full checks)" "tensor swiglu_t" "tensor swiglu_t (full checks)" "tensor 128x64 swiglu_t" \
             "tensor residual_norm_stats_t" "tensor residual_norm_stats_t (full checks)" ;;
    stepprofile) run stepprofile ${PROFILE_LIMIT:-300} python3 bench/probes/model_step_profile.py --config 1b \
                   --out "$out/stepprofile.json" ;;
    modelcompile) run modelcompile ${MODEL_LIMIT:-560} python3 bench/model.py --configs ${MODEL_CONFIGS:-1b} \
                    --variants ${MODEL_VARIANTS:-liger,compile,coda,coda-compile} ${COMPILE_MODE:+--compile-mode $COMPILE_MODE} \
                    --out "$out/modelcompile" ;;
    attention) run attention ${PROBE_LIMIT:-240} bash -c "python3 bench/probes/attention_layouts.py --width 8b \
                 --out $out/attention_8b.json && python3 bench/probes/attention_layouts.py --width 1b --out $out/attention_1b.json" ;;
    attentionmodel) run attention_model ${MODEL_LIMIT:-300} python3 bench/model.py --configs 1b \
                 --variants coda,coda@heads,coda@heads_repeated --out "$out/attention_model" ;;
    copies) for c in ${COPIES_CONFIGS:-1b 8b}; do for how in "1" "8" "8 --folds-together"; do
              tag=$(echo $how | tr -d ' -')
              run copies_${c}_$tag ${PROFILE_LIMIT:-130} python3 bench/probes/model_step_profile.py --config $c \
                --variants coda-fp8-tensorwise --steps 8 --copies-per-call $how --out "$out/copies_${c}_$tag.json"
            done; done ;;
    hostprofile) run hostprofile ${PROFILE_LIMIT:-300} python3 bench/probes/model_step_profile.py --config 1b \
                   --variants coda,coda-fp8-tensorwise --steps 4 --host-profile 45 --out "$out/hostprofile.json" ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
