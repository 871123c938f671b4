#!/bin/bash
# The round engines' GPU check, one call on a lent GPU (about 9 minutes):
#  1. FEMNIST CNN, 100 clients per round: the defaults (vmap engine, lanes,
#     segment steps and slots 'auto'/4/'auto', im2col convolutions) in
#     float32 and bfloat16 against FedJAX's jit backend, each followed by a
#     profiled round (trace and summary under $OUT/profiles);
#  2. the 21M Transformer (Ro et al. 2022), 100 clients: the same, without
#     profiles.
# Everything goes under $OUT as it comes: log.txt, rounds_*.md (rewritten
# after every row), profiles/*.json and their Perfetto traces.
#
#   OUT=/tmp/gpu bash benchmarks/gpu_check.sh
#
# .dev/ (git-ignored, e.g. via .git/info/exclude; carried to the device)
# holds the wheels the device lacks and FEMNIST (else $FEDLITE_DATA_DIR,
# else synthetic FEMNIST):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
#     --platform manylinux2014_x86_64 -d .dev/whl fedjax==0.0.17 \
#     dm-haiku==0.0.17 jmp==0.0.4 dp-accounting==0.6.0 dm-tree mlxtend \
#     tensorboardX==2.6.5
#   mkdir -p .dev/data && cp -r "$FEDLITE_DATA_DIR/femnist105" .dev/data/
set -u
OUT=${OUT:-/tmp/gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LOG=$OUT/log.txt
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -d .dev/whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/site .dev/whl/*.whl >>"$LOG" 2>&1
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
[ -d .dev/data/femnist105 ] && export FEDLITE_DATA_DIR=$PWD/.dev/data
nvidia-smi >>"$LOG" 2>&1
python3 -c 'import jax, fedjax; print(jax.__version__, jax.devices())' \
  >>"$LOG" 2>&1

stage() {  # name cap bench_rounds.py flags...
  local name=$1 cap=$2; shift 2
  echo "== $name ($(date +%T), cap ${cap}s)" | tee -a "$LOG"
  local t0=$SECONDS
  timeout "$cap" python3 benchmarks/bench_rounds.py --engines=vmap,fedjax_jit \
    --compute_dtype=float32,bfloat16 --cohorts=100 "$@" >>"$LOG" 2>&1
  echo "== $name rc=$? in $((SECONDS - t0))s" | tee -a "$LOG"
}
stage femnist 210 --models=femnist --rounds=5 --total_seconds=150 \
  --profile --profile_dir="$OUT/profiles" --output="$OUT/rounds_femnist.md"
stage transformer_large 300 --models=transformer_large --rounds=4 \
  --total_seconds=230 --output="$OUT/rounds_transformer_large.md"
find "$OUT/profiles" -name '*.xplane.pb' -delete 2>/dev/null
grep -E '^\| (femnist|transformer)|profiled round' "$LOG" | tail -20
