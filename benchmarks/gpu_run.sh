#!/usr/bin/env bash
# The prepared run for a lent GPU machine (docs/gpu.md, "The device check"): one command, each part under
# its own time limit, so a part that hangs costs its limit and not the lease (about 6 minutes in all).
#
#   bash benchmarks/gpu_run.sh            # on the GPU machine, from the repository root; writes to $OUT
#
# 1. gpu_check: the fp32 oracle, bf16 agreement, both throughput shapes with the kernel profile, the
#    stacked projections' A/B and the roofline steps (bare, queued, as the engine runs them);
# 2. the host's side of a decode step on this machine's CPU (benchmarks/engine_host.py --executor torch),
#    to set beside the device's step: overlap hides the host only where the device takes longer;
# 3. with xformers' wheel carried in .whl: bm's decode kernel against xformers' over 32- and 64-token
#    blocks (benchmarks/decode_attention_peers.py);
# 4. quantized weights (issue 57): bm's Triton GEMM over int8, int4 and FP8 weights against cuBLAS bf16
#    and torch._scaled_mm per layer (benchmarks/quant_gemm_gpu.py), then the 1B shape's throughput and
#    roofline with FP8 weights and an fp8 KV cache, against part 1's bf16 figures.
# Run `make test-gpu-stack` on the CPU first: it runs the GPU path's tests under the GPU machines'
# transformers.
set -u
OUT=${OUT:-bm-out/gpu-run}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

timeout 360 python3 benchmarks/gpu_check.py --sections oracle,bf16,throughput \
  --shapes llama-1b,smollm2-135m --no-hf --profile --ab-projections --out "$OUT/gpu_check.json" \
  2>&1 | tee "$OUT/gpu_check.log"
echo "gpu_check: exit ${PIPESTATUS[0]}"

timeout 60 python3 benchmarks/engine_host.py --requests 256 --overlap off,on --repeats 3 \
  --executor torch > "$OUT/engine_host.json" 2> "$OUT/engine_host.log"
echo "engine_host: exit $?"

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
  for b in 32 64; do
    PYTHONPATH=$PWD:/tmp/site timeout 90 python3 benchmarks/decode_attention_peers.py --block-size "$b" \
      --budget-s 20 --out "$OUT/peers_$b.json" > "$OUT/peers_$b.log" 2>&1
    echo "decode_attention_peers --block-size $b: exit $?"
  done
fi
timeout 90 python3 benchmarks/quant_gemm_gpu.py --out "$OUT/quant_gemm.json" > "$OUT/quant_gemm.log" 2>&1
echo "quant_gemm_gpu: exit $?"
timeout 150 python3 benchmarks/gpu_check.py --sections throughput --shapes llama-1b --no-hf --no-hf-cb \
  --quantization fp8 --kv-cache-dtype fp8_e4m3 --out "$OUT/gpu_check_fp8.json" > "$OUT/gpu_check_fp8.log" 2>&1
echo "gpu_check fp8 weights and KV: exit $?"
ls -l "$OUT"
