#!/usr/bin/env bash
# Everything one device call should do, in order: build + check one spec, the L1 suite
# (kernels precompiled in parallel first), host overhead, the forward benchmark.
#   usage (on the device machine): bash bench/device_batch.sh COMMIT [pytest args...]
# Logs and results go to $OUT (the device tool brings them back).
set -uo pipefail
commit=${1:?commit}; shift
out=${OUT:-/tmp/fa_gen_out}; mkdir -p "$out"
export FA_GEN_CACHE_DIR=${FA_GEN_CACHE_DIR:-/tmp/fa_gen_cache} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/gpu.txt"
{ python -m fa_gen.cli build causal_bf16_d128 && python -m fa_gen.cli check sliding_window_bf16_d128 --trials 6; } \
  2>&1 | tee "$out/build.log"
FA_GEN_PRECOMPILE_JOBS=${JOBS:-16} python -m pytest -m gpu -q -p no:cacheprovider \
  --hypothesis-show-statistics "$@" 2>&1 | tee "$out/l1.log"
python bench/load_time.py causal_bf16_d128 2>&1 | tee "$out/load.log"
python bench/overhead.py 2>&1 | tee "$out/overhead.log"
python bench/bench_forward.py --commit "$commit" --out "$out" --plot ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
