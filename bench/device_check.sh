#!/usr/bin/env bash
# One call on the GPU machine: environment, the test suite compiled on the GPU, the kernel fuzz,
# the benchmark suites and the demo. Results land under $OUT (./out when OUT is unset).
# Usage there: PQATTN_GIT_SHA=<sha> bash bench/device_check.sh [bench arguments, default: all suites --quick]
set -uo pipefail
export PYTHONPATH=src PYTHONUNBUFFERED=1
OUT=${OUT:-out}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/gpu.txt"
python3 -m pytest -q -x 2>&1 | tee "$OUT/pytest.log" | tail -4
python3 -m pqattn check --json "$OUT/check.json" 2>"$OUT/check.log" | tail -30
if [ $# -eq 0 ]; then set -- select decode build prefill --quick; fi
python3 -m pqattn bench "$@" --json "$OUT/bench.json" --plot "$OUT/bench.png" 2>"$OUT/bench.log"
python3 -m pqattn demo --device cuda --json "$OUT/demo.json" >/dev/null
