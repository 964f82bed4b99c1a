#!/usr/bin/env bash
# The GPU check: the `gpu` tests (engine on CUDA, the device-resident MoE step against the cached one, the fused MXFP4 kernel at GPT-OSS-20B widths, the fused
# FP8/int8/int4 kernel at Qwen3-30B-A3B widths), prefetch off vs on (copy stream), the engine benchmark on CUDA,
# then the fused MoE kernels' GB/s at T = 1, 4, 128 against the device's copy rate (bench/kernel_rates.py, a
# captured CUDA graph replayed): short tables last; first, the decode kernels' SASS per packed byte on this
# GPU's arch (bench/kernel_sass.py, no launch), to read beside the GB/s.
# Run only on a machine with a CUDA GPU (under 8 minutes on one H200). Needs torch and transformers;
# textual is not needed. Usage: bash bench/gpu_check.sh
# Timeouts add up to 480 s (20 + 150 + 100 + 35 + 30 + 35 + 25 + 85); a failing gpu test stops the script, a bench that runs out of time says so and the
# next one runs.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="${PYTHONPATH:-}"
python - <<'PY'
import torch
assert torch.cuda.is_available(), "no CUDA device: run this on a GPU machine"
print("device:", torch.cuda.get_device_name(0), "| torch", torch.__version__)
PY
# The project may not be installed there: put an import shim for `moechat` on the path.
shim=$(mktemp -d)
mkdir -p "$shim/moechat"
ln -s "$PWD/engine" "$shim/moechat/engine"
ln -s "$PWD/app" "$shim/moechat/app"
export PYTHONPATH="$shim:$PYTHONPATH"
# the decode kernels' SASS instructions per packed byte for this device's compute capability (compiled, not run)
cap=$(python -c "import torch; a, b = torch.cuda.get_device_capability(0); print(10 * a + b)")
timeout 20 python bench/kernel_sass.py --arch "$cap" --workers 8 || echo "bench/kernel_sass.py: exit $?"
timeout 150 python -m pytest -q -m gpu tests/engine/test_gpu.py tests/engine/quant/test_mxfp4_triton.py \
    tests/engine/test_gpu_hybrid.py tests/engine/quant/test_slot_lookup.py tests/engine/cache/test_transfer_protocol.py \
    tests/engine/cache/test_gpu_transfer_bench.py tests/engine/cache/test_host_embeddings.py \
    tests/engine/test_device_step.py tests/engine/test_device_step_protocol.py -p no:cacheprovider 2>&1 | tail -8
# the fused FP8 / int8 / int4 MoE kernel at Qwen3-30B-A3B widths, and expert_compute dispatching to it; GGUF experts on
# CUDA through the Triton GGUF kernel
timeout 100 python -m pytest -q -m gpu tests/engine/quant/test_quant_triton.py tests/engine/quant/test_gguf_triton.py \
    -p no:cacheprovider 2>&1 | tail -4
# the recurrent layers' Triton decode steps (delta rule, Mamba-2, conv) at Qwen3.6 / Nemotron-3 widths, and the dispatch
timeout 60 python -m pytest -q -m gpu tests/engine/test_recurrent_triton.py -p no:cacheprovider 2>&1 | tail -4
# hybrid execution: load over PCIe vs host (CPU while the GPU runs the resident experts) vs auto
timeout 35 python bench/hybrid.py --device cuda --runs 3 --tokens 32 --fractions 0.25 --layers 1 2>&1 \
    | grep -v "Writing model shards" || echo "bench/hybrid.py: exit $?"
timeout 30 python bench/prefetch.py --device cuda --tier ram --runs 3 --new 64 2>&1 | tail -18 || echo "bench/prefetch.py: exit $?"
timeout 35 python bench/engine_vs_transformers.py --device cuda --runs 3 2>&1 | grep -v "Writing model shards" \
    || echo "bench/engine_vs_transformers.py: exit $?"
# the link: one 13.2 MB MXFP4 expert pinned -> device as one copy and as six, a layer's misses on the copy stream
# under compute, device-to-device (the aim: a miss at >= 0.8 of the link rate)
timeout 25 python bench/gpu_transfer.py --reps 10 || echo "bench/gpu_transfer.py: exit $?"
# the fused MoE kernels' GB/s of packed bytes at T = 1, 4 (decode: one kernel pair) and 128 (prefill), MXFP4 at
# GPT-OSS-20B widths, FP8 / int8 / int4 at Qwen3-30B-A3B's (compiled by the tests above: cached), each timed by
# replaying a captured CUDA graph, against the device's copy rate: the table last
timeout 85 python bench/kernel_rates.py --tokens 1,4,128 || echo "bench/kernel_rates.py: exit $?"
