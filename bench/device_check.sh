#!/usr/bin/env bash
# One call on the GPU machine: environment, the whole test suite compiled on the GPU, the demo.
# Usage there: bash bench/device_check.sh   (writes under $OUT, or ./out when OUT is unset)
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q 2>&1 | tee "$OUT/pytest.log" | tail -4
python3 -m pqattn demo --device cuda --json "$OUT/demo.json"
