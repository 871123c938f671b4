#!/bin/bash
# The lane engine's GPU check, one call on a lent GPU, results under $OUT as
# they come (one log, one JSON per profile, the step timings, the rounds
# table). Stages run in order of importance, each under its own time cap.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh [stage ...]
#
# .dev/ (git-ignored, e.g. via .git/info/exclude; carried to the device):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .dev/whl fedjax==0.0.17 \
#     dm-haiku==0.0.17 jmp==0.0.4 dp-accounting==0.6.0 dm-tree mlxtend \
#     tensorboardX==2.6.5
#   cp -r "$FEDLITE_DATA_DIR/femnist105" "$FEDLITE_DATA_DIR/shakespeare" .dev/data/
#
# Stages: profile_lm profile_cnn steps steps_scatter phases phases_fixed
# phases_noprefetch rounds_cnn rounds_lm rounds_graphs round800_bf16
# rounds_bf16_noautotune rounds_bf16_notriton compile_cache
# rounds_ratio_lanes rounds50_cnn rounds_cnn_compile_flags round_inputs
# (default: profile_cnn rounds_cnn rounds_lm, ~540 s of caps, in order of
# importance; a stage cut by the call's limit keeps its finished rows: the
# FEMNIST profile, then the round targets with, in the same
# process and on the same cohorts, each default that no GPU has measured
# against its alternatives (bench_rounds.py --variants; the notes give
# each variant's s/round against the defaults'); a second call, as the
# device time left allows: round800_bf16 steps rounds50_cnn round_inputs
# (~370 s of caps), then rounds_ratio_lanes rounds_graphs compile_cache
# (~500 s)).
# rounds_cnn: the FEMNIST rounds against FedJAX's jit ($AB_CNN): first
# the host loop with scatter starts (the masked step called at every
# step, the finalizations and starts before it where clients end; no
# conditional and no device loop: XLA:GPU's optimized HLO, compiled
# without a GPU, copies no lane state and launches 46 kernels where no
# client ends, against 85-90 and 0.98 GB copied per step for a scan
# segment, bench_lane_cost.py --target=h200), then the batches cut,
# stacked and sent by the host (data_on_device=off; the default on a GPU
# gathers them on the device from rows), a while loop with scatter starts
# (no state copied either; its predicate read back every step), segments
# of 16 steps, segments without conditionals (segment_loop=fixed), the
# slots' starts as one scatter per state leaf after the conditional (the
# default writes rows in a loop over the slots inside it: 590 kernels at
# a transition against 105), lax convolutions (vmapped: cuDNN's grouped
# convolutions) instead of im2col matmuls (im2col's concatenations and
# transposes held ~26% of the kernel time), and the host loop with row
# starts; rounds_lm: the 21M Transformer against FedJAX's jit ($AB_LM):
# the host loop with scatter starts (a scan segment copies 13.3 GB per
# step there, ~2.8 ms at 4.8 TB/s), scatter starts alone, bfloat16, and
# bfloat16 with the host loop and scatter starts (the bfloat16 target);
# round_inputs: the host time of a round's lane inputs both ways, with a
# client update that only sums its batches; rounds50_cnn: the FEMNIST
# target's 50-round run with its compiling, against FedJAX's jit;
# compile_cache: the runner's compile seconds on an empty
# --compilation_cache_dir and again on the filled one (FEMNIST and the
# 21M Transformer on Shakespeare, 2 rounds of 100 clients);
# rounds_ratio_lanes: the rounds on the lanes of the rule before (the most
# lanes planning <= 1.10x the useful steps), against rounds' lanes of the
# cost rule (bench_lane_plans.py); profile_cnn also copies its trace,
# whose host_calls show which program calls block the host; the phases'
# "wait inputs" is the caller waiting for the prefetch thread;
# rounds_graphs: XLA:GPU's command buffers also take conditionals and
# while loops (CUDA graphs with on-device control flow), so that a scan
# segment's conditionals need not read their predicates back to the host;
# steps: one client's step, the plain vmapped step at two lane counts per
# model (8 and 39 Transformer lanes, 51 and 100 CNN lanes: a step's fixed
# cost in lane-steps, which lanes.AUTO_STEP_COST_LANES puts at 4), the
# transition step and the segment; steps_scatter times the idle lane-step
# (its conditional; no finalization, no starts) against the masked step;
# rounds_bf16_noautotune: round800_bf16 with XLA:GPU's GEMM autotuning off,
# how much of the 800-client round's compiling is autotuning;
# rounds_bf16_notriton: the same with XLA:GPU's Triton GEMMs off, cuBLAS
# only, whose tiling configurations are not compiled and autotuned;
# rounds_cnn_compile_flags: the FEMNIST rounds with each of those two
# flags, whose compile seconds bound the 50-round target's: FEMNIST's
# lane programs took 7.7 s to compile against 3.4 s for FedJAX's). Wheels
# of missing packages may travel in .dev/whl, FEMNIST in .dev/data (else
# $FEDLITE_DATA_DIR, else synthetic FEMNIST).
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
if [ -d .dev/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .dev/whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=$PWD:/tmp/site
fi
[ -d .dev/data/femnist105 ] && export FEDLITE_DATA_DIR=$PWD/.dev/data
nvidia-smi >>"$LOG" 2>&1
python3 -c 'import jax, fedjax; print(jax.__version__, jax.devices())' \
  >>"$LOG" 2>&1
# The GPU's own GpuTargetConfig, for bench_lane_cost.py --target=<file>
# (XLA:GPU compiling for this GPU on a machine without one).
python3 -c 'import jax; from jax._src.lib import xla_client as xc
print(xc.get_topology_for_devices(jax.devices()).target_config)' \
  >"$OUT/target_config.txtpb" 2>>"$LOG"

stage() {  # name cap command...
  local name=$1 cap=$2; shift 2
  echo "== $name ($(date +%T), cap ${cap}s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$cap" "$@" >>"$LOG" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
# The rounds stages' variants (bench_rounds.py --variants): each against
# the defaults in the same process, on the same cohorts.
AB_CNN="segment_loop=host,lane_starts=scatter;data_on_device=off;\
segment_loop=while,lane_starts=scatter;segment_steps=16;segment_loop=fixed;\
lane_starts=scatter;conv_implementation=lax;segment_loop=host"
AB_LM="segment_loop=host,lane_starts=scatter;lane_starts=scatter;\
compute_dtype=bfloat16;compute_dtype=bfloat16,segment_loop=host,\
lane_starts=scatter"
P=benchmarks/profile_rounds.py
B=benchmarks/bench_rounds.py
run_stage() {
  case $1 in
    profile_lm) stage profile_lm 150 python3 $P --model=transformer_large \
      --engine=vmap --cohort=100 --warmup_rounds=1 --rounds=2 --top=30 \
      --no-hlo_dump --output="$OUT/profile_transformer_large.json" ;;
    profile_cnn) stage profile_cnn 70 python3 $P --model=femnist \
      --engine=vmap --cohort=100 --warmup_rounds=1 --rounds=3 --top=30 \
      --no-hlo_dump --output="$OUT/profile_femnist.json"
      python3 -c 'import json,shutil,sys; shutil.copy(json.load(open(sys.argv[1]))["trace_file"], sys.argv[2])' \
        "$OUT/profile_femnist.json" "$OUT/trace_femnist.json.gz" >>"$LOG" 2>&1 ;;
    steps) stage steps 100 python3 benchmarks/bench_lane_step.py \
      --models=transformer_large,femnist --dtypes=float32 \
      --kinds=client,vmap,transition,segment \
      --output="$OUT/lane_step.jsonl" ;;
    steps_scatter) stage steps_scatter 120 python3 \
      benchmarks/bench_lane_step.py --models=transformer_large,femnist \
      --dtypes=float32 --kinds=idle,transition,segment,idle_cond \
      --starts=scatter --output="$OUT/lane_step_scatter.jsonl" ;;
    phases) stage phases 40 python3 benchmarks/round_phases.py \
      --model=femnist --engine=vmap --cohort=100 --warmup_rounds=2 \
      --rounds=3 --output="$OUT/phases_femnist.json" ;;
    phases_fixed) stage phases_fixed 40 python3 benchmarks/round_phases.py \
      --model=femnist --engine=vmap --cohort=100 --warmup_rounds=2 \
      --rounds=3 --segment_loop=fixed \
      --output="$OUT/phases_femnist_fixed.json" ;;
    phases_noprefetch) stage phases_noprefetch 40 python3 \
      benchmarks/round_phases.py --model=femnist --engine=vmap --cohort=100 \
      --warmup_rounds=2 --rounds=3 --no-prefetch \
      --output="$OUT/phases_femnist_noprefetch.json" ;;
    rounds_cnn) stage rounds_cnn 170 python3 $B --models=femnist \
      --engines=vmap,fedjax_jit --cohorts=100 --rounds=5 --extra= \
      --no-fixed_cost --variants="$AB_CNN" --output="$OUT/rounds_femnist.md" ;;
    rounds_lm) stage rounds_lm 300 python3 $B --models=transformer_large \
      --engines=vmap,fedjax_jit --cohorts=100 --rounds=4 --extra= \
      --no-fixed_cost --variants="$AB_LM" \
      --output="$OUT/rounds_transformer_large.md" ;;
    rounds_graphs) stage rounds_graphs 120 env XLA_FLAGS="${XLA_FLAGS:-} \
--xla_gpu_enable_command_buffer=+CONDITIONAL,+WHILE" python3 $B \
      --models=femnist,transformer_large --engines=vmap --cohorts=100 \
      --rounds=5 --extra= --no-fixed_cost --output="$OUT/rounds_graphs.md" ;;
    round_inputs) stage round_inputs 60 python3 \
      benchmarks/bench_round_inputs.py --cohort=100 --lanes_per_device=50 \
      --output="$OUT/round_inputs.json" ;;
    rounds50_cnn) stage rounds50_cnn 100 python3 $B --models=femnist \
      --engines=vmap,fedjax_jit --cohorts=100 --rounds=50 --extra= \
      --no-fixed_cost --output="$OUT/rounds50_femnist.md" ;;
    round800_bf16) stage round800_bf16 110 python3 $B \
      --models=transformer_large --engines=vmap --cohorts=800 --rounds=2 \
      --compute_dtype=bfloat16 --extra= --no-fixed_cost \
      --output="$OUT/round800_bf16.md" ;;
    rounds_bf16_noautotune) stage rounds_bf16_noautotune 110 env \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" python3 $B \
      --models=transformer_large --engines=vmap --cohorts=800 --rounds=2 \
      --compute_dtype=bfloat16 --extra= --no-fixed_cost \
      --output="$OUT/round800_bf16_noautotune.md" ;;
    rounds_bf16_notriton) stage rounds_bf16_notriton 110 env \
      XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_triton_gemm=false" python3 $B \
      --models=transformer_large --engines=vmap --cohorts=800 --rounds=2 \
      --compute_dtype=bfloat16 --extra= --no-fixed_cost \
      --output="$OUT/round800_bf16_notriton.md" ;;
    rounds_ratio_lanes)  # The lanes of the rule before the cost rule.
      for m in femnist transformer_large; do
        lanes=$(python3 benchmarks/bench_lane_plans.py --memory_gib=device \
          --print_ratio_lanes=$m 2>>"$LOG" | tail -1)
        stage rounds_ratio_lanes_$m 90 python3 $B --models=$m \
          --engines=vmap --cohorts=100 --rounds=5 --extra= --no-fixed_cost \
          --lanes_per_device="$lanes" --output="$OUT/rounds_ratio_lanes_$m.md"
      done ;;
    rounds_cnn_compile_flags)  # XLA:GPU's GEMM autotuning, Triton GEMMs.
      for f in --xla_gpu_autotune_level=0 --xla_gpu_enable_triton_gemm=false; do
        n=${f#--xla_gpu_}; n=${n%%=*}
        stage rounds_cnn_$n 60 env XLA_FLAGS="${XLA_FLAGS:-} $f" python3 $B \
          --models=femnist --engines=vmap --cohorts=100 --rounds=5 --extra= \
          --no-fixed_cost --output="$OUT/rounds_cnn_$n.md"
      done ;;
    compile_cache) stage compile_cache 200 python3 \
      benchmarks/bench_run_compilations.py \
      --runs=emnist,shakespeare_transformer --rounds=2 --clients=100 \
      --compilation_cache --output="$OUT/compilation_cache.md" ;;
    *) echo "unknown stage $1" | tee -a "$LOG" ;;
  esac
}
for s in "${@:-profile_cnn rounds_cnn rounds_lm}"; do
  for t in $s; do run_stage "$t"; done
done
grep -E "^ +(transformer|femnist)|^round |^\| (femnist|transformer)|^variants" \
  "$LOG" | tail -40
