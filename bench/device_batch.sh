#!/usr/bin/env bash
# What the device calls run, in parts that each fit one call (10 minutes):
#   bash bench/device_batch.sh COMMIT l1     build + check one spec, the whole L1 suite
#                                             (kernels precompiled in parallel), load time, overhead
#   bash bench/device_batch.sh COMMIT bench   the forward benchmark over every anchor (bf16 with
#                                             FlexAttention, fp16 without), and the backward rows
#   bash bench/device_batch.sh COMMIT fwdtable  issue 19's forward table (bf16 and fp16, d64/d128/d256,
#                                             512-16k, three rounds) beside FA4, cuDNN and FA2 (about 3 min)
#   bash bench/device_batch.sh COMMIT bwdtable  its backward table (bf16 and fp16, d64/d128, 1k-16k, two
#                                             rounds; per call and back to back) (about 4 min)
#   bash bench/device_batch.sh COMMIT decode  decode (seqlen_q = 1) GB/s and varlen-prefill TFLOP/s
#                                             beside FA4, cuDNN and FA2 (bench/bench_decode.py)
#   bash bench/device_batch.sh COMMIT inference  the inference L1 suites (varlen, varlen backward,
#                                             combine, kvcache, FA-compatible API + transformers)
#                                             with FA_GEN_L1_EXAMPLES (default 40), one log each
#   bash bench/device_batch.sh COMMIT new     the suites of kernels not yet run on a GPU: head dims off the
#                                             measured set (sm90 padded forward included) and dropout
#   bash bench/device_batch.sh COMMIT mla     MLA decode: its L1 suite, then GB/s against the copy bandwidth
#                                             (bench/bench_mla.py)
#   bash bench/device_batch.sh COMMIT longrun  10^6 decode steps eager and from a CUDA graph: growth in memory or
#                                             host time (bench/long_run.py; --calls to shorten)
#   bash bench/device_batch.sh COMMIT sanitize  every kernel kind once under compute-sanitizer's four
#                                             tools (bench/sanitize.py --tools), one summary line each
#   bash bench/device_batch.sh COMMIT verify  the newest suites (adversarial shapes, the ring on one GPU, dropout
#                                             with Hopper's backward, non-finite inputs, MLA), then the cached
#                                             load time and the forward L1 suite (fast load is the default)
#   bash bench/device_batch.sh COMMIT dropout  dropout speed rows: p = 0.1 vs p = 0 vs FA2 (bench/bench_dropout.py)
#   bash bench/device_batch.sh COMMIT fp8     the fp8 forward: its L1 suite, then TFLOP/s beside fa_gen bf16, cuDNN and FA4
#                                             with the tile sweep (bench/bench_fp8.py --sweep), then the V
#                                             transposes' speed and the fp8 call's GPU and host time
#   bash bench/device_batch.sh COMMIT ring    context parallelism on every GPU of the host: the NCCL ring against the
#                                             simulated one (tests/test_gpu_ring_nccl.py), then throughput (torchrun; bench/bench_ring.py)
#   bash bench/device_batch.sh COMMIT e2e     a 1B Llama-style model in transformers, fa_gen vs SDPA:
#                                             prefill and decode tokens/s, attention share (bench/bench_e2e.py)
#   bash bench/device_batch.sh COMMIT bwdtests  the backward suites (fixed length, varlen), each under a timeout
#                                             (a hung kernel reads as rc 124 rather than eating the call)
#   bash bench/device_batch.sh COMMIT bwdab BASE  this tree's backward against .ab/BASE (made here first with
#                                             `python bench/ab_sources.py prepare BASE`), two rounds, bf16
#                                             d64 and d128 at 1k, 2k and 4k beside FA4 (bench/ab_sources.py)
# Logs and results go to $OUT (the device tool brings them back).
set -uo pipefail
commit=${1:?commit}; part=${2:?l1, bench, decode, inference, new, verify, fp8, dropout, mla, longrun, sanitize, ring, e2e, bwdtests, bwdab, fwdtable or bwdtable}; shift 2
out=${OUT:-/tmp/fa_gen_out}; mkdir -p "$out"
export FA_GEN_CACHE_DIR=${FA_GEN_CACHE_DIR:-/tmp/fa_gen_cache} PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 FA_GEN_PRECOMPILE_JOBS=${JOBS:-16}
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee -a "$out/gpu.txt"
if [[ $part == l1 ]]; then
  { python -m fa_gen.cli build causal_bf16_d128 && python -m fa_gen.cli check sliding_window_bf16_d128 --trials 6; } \
    2>&1 | tee "$out/build.log"
  python -m pytest -m gpu -q -p no:cacheprovider --hypothesis-show-statistics "$@" 2>&1 | tee "$out/l1.log"
  python bench/load_time.py causal_bf16_d128 2>&1 | tee "$out/load.log"
  python bench/overhead.py 2>&1 | tee "$out/overhead.log"
elif [[ $part == inference ]]; then
  export FA_GEN_L1_EXAMPLES=${FA_GEN_L1_EXAMPLES:-40}
  for suite in test_gpu_varlen test_gpu_varlen_backward test_gpu_combine test_gpu_kvcache test_gpu_flash_api; do
    python -m pytest -q -p no:cacheprovider "tests/$suite.py" "$@" > "$out/$suite.log" 2>&1
    echo "$suite: $(tail -1 "$out/$suite.log")"
  done
elif [[ $part == new ]]; then
  export FA_GEN_L1_EXAMPLES=${FA_GEN_L1_EXAMPLES:-25}
  for suite in test_gpu_head_dims test_gpu_dropout; do
    python -m pytest -q -p no:cacheprovider "tests/$suite.py" "$@" > "$out/$suite.log" 2>&1
    echo "$suite: $(tail -1 "$out/$suite.log")"
  done
elif [[ $part == verify ]]; then
  export FA_GEN_L1_EXAMPLES=${FA_GEN_L1_EXAMPLES:-25}
  for suite in test_gpu_adversarial test_gpu_distributed test_gpu_dropout test_gpu_nonfinite test_gpu_mla; do
    python -m pytest -q -p no:cacheprovider "tests/$suite.py" "$@" > "$out/$suite.log" 2>&1
    echo "$suite: $(tail -1 "$out/$suite.log")"
  done
  python bench/load_time.py causal_bf16_d128 2>&1 | tee "$out/load_time.log"
elif [[ $part == fp8 ]]; then
  export FA_GEN_L1_EXAMPLES=${FA_GEN_L1_EXAMPLES:-60}
  python -m pytest -q -p no:cacheprovider tests/test_gpu_fp8.py > "$out/test_gpu_fp8.log" 2>&1
  echo "test_gpu_fp8: $(tail -1 "$out/test_gpu_fp8.log")"
  python bench/bench_fp8.py --commit "$commit" --out "$out" --sweep "$@" 2>&1 | tee "$out/bench_fp8.log"
  python bench/transpose_v_speed.py 2>&1 | tee "$out/transpose_v_speed.log"
elif [[ $part == dropout ]]; then
  python bench/bench_dropout.py --commit "$commit" --out "$out" "$@" 2>&1 | tee "$out/bench_dropout.log"
elif [[ $part == mla ]]; then
  export FA_GEN_L1_EXAMPLES=${FA_GEN_L1_EXAMPLES:-40}
  python -m pytest -q -p no:cacheprovider tests/test_gpu_mla.py "$@" > "$out/test_gpu_mla.log" 2>&1
  echo "test_gpu_mla: $(tail -1 "$out/test_gpu_mla.log")"
  python bench/bench_mla.py --commit "$commit" --out "$out" 2>&1 | tee "$out/bench_mla.log"
elif [[ $part == longrun ]]; then
  python bench/long_run.py --commit "$commit" --out "$out" "$@" 2>&1 | tee "$out/long_run.log"
elif [[ $part == sanitize ]]; then
  python bench/sanitize.py --tools --out "$out" "$@" 2>&1 | tee "$out/sanitize.log"
elif [[ $part == ring ]]; then
  gpus=$(nvidia-smi --list-gpus | wc -l)
  python -m pytest -q -p no:cacheprovider tests/test_gpu_ring_nccl.py > "$out/test_gpu_ring_nccl.log" 2>&1
  echo "test_gpu_ring_nccl: $(tail -1 "$out/test_gpu_ring_nccl.log")"
  torchrun --standalone --nproc_per_node "$gpus" bench/bench_ring.py --commit "$commit" --out "$out" "$@" 2>&1 | tee "$out/bench_ring.log"
elif [[ $part == e2e ]]; then
  python bench/bench_e2e.py --commit "$commit" --out "$out" --profile "$@" 2>&1 | tee "$out/bench_e2e.log"
elif [[ $part == bwdtests ]]; then
  for suite in test_gpu_backward test_gpu_varlen_backward; do
    timeout 280 python -m pytest -q -p no:cacheprovider "tests/$suite.py" "$@" > "$out/$suite.log" 2>&1
    echo "$suite: rc $? $(tail -1 "$out/$suite.log")" | tee -a "$out/summary.log"
  done
elif [[ $part == fwdtable ]]; then
  python bench/bench_forward.py --commit "$commit" --suffix table --out "$out" --dtypes bf16,fp16 \
    --head-dims 64,128,256 --seqlens 512,1024,2048,4096,8192,16384 --impls fa_gen,sdpa_flash,sdpa_cudnn,fa4 \
    --rounds 3 --plot "$@" 2>&1 | tee "$out/fwd-table.log"
elif [[ $part == bwdtable ]]; then
  python bench/bench_forward.py --commit "$commit" --suffix table --out "$out" --backward --dtypes bf16,fp16 \
    --head-dims 64,128 --seqlens 1024,2048,4096,8192,16384 --impls fa_gen,sdpa_flash,sdpa_cudnn,fa4 \
    --rounds 2 "$@" 2>&1 | tee "$out/bwd-table.log"
elif [[ $part == bwdab ]]; then
  base=${1:?the base tree, under .ab/}; shift
  python bench/ab_sources.py run ".ab/$base" . --rounds 2 --bench backward --json "$out/ab-$base.json" -- \
    --head-dims 64,128 --seqlens 1024,2048,4096 --impls fa_gen_sm90,fa4 "$@" 2>&1 | tee "$out/ab-$base.log"
elif [[ $part == decode ]]; then
  python bench/bench_decode.py --commit "$commit" --out "$out" --plot "$@" 2>&1 | tee "$out/bench_decode.log"
else
  python bench/bench_forward.py --commit "$commit" --out "$out" --plot --dtypes bf16 "$@" 2>&1 | tee "$out/bench.log"
  python bench/bench_forward.py --commit "$commit-fp16" --out "$out" --dtypes fp16 --head-dims 64,128 \
    --seqlens 512,2048,8192,16384 --impls fa_gen,fa_gen_sm80,sdpa_flash,sdpa_cudnn,fa4 2>&1 | tee "$out/bench_fp16.log"
  python bench/bench_forward.py --commit "$commit" --out "$out" --backward --dtypes bf16 --head-dims 64,128 \
    --seqlens 1024,4096,8192,16384 2>&1 | tee "$out/bench_bwd.log"
fi
