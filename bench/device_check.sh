#!/usr/bin/env bash
# The GPU session script, run on the lent H200 from the device tool's copy of the checkout.
# Here, once, before the session: `make device-bundle` (.whl/: hsx's own wheel and the wheels the
# image lacks, for its Python 3.12; bench/device_bundle.py says which and why). Then:
#   run(command="bash bench/device_check.sh", carry=[".whl"], timeout_s=480)
# and, at once while the machine is warm (it goes back after 30 s idle), the rerun of the step
# that matters most, if its first run was cut short (fla's first autotune can take minutes):
#   run(command="STEPS=qwen35-fla bash bench/device_check.sh", carry=[".whl"], timeout_s=200)
# 15 minutes of device time per session in all, the machine's start (a few minutes) included.
#
# Steps, in this order, each under `timeout` min(its cap, the time left of BUDGET_S, default
# 450 s); a step with less than NEED_S left is skipped and says so in bench.log:
#   install  the wheels into $SITE (pip --no-index, .whl only), then `device_bundle.py check`:
#            hsx-extract[gpu]'s and the bundle's requirements met, every service imports, nats-server;
#            env.txt: GPU, driver, Python/torch/CUDA/transformers/triton, fla, flash-attn, disks.
#            A failure here ends the script (exit 1) before any GPU time is spent on it.
#   qwen35-fla       (cap 160 s) bench/gpu.py, Qwen3.5-27B's shape at 24 of its 64 layers, 2 layers
#                    captured: the seeds' bytes per FLOP (bench/gpu.py says why); fla's kernels;
#                    spool on the disk and on tmpfs -> qwen35-fla.jsonl
#   gpu-tests        (cap 90 s) pytest -m gpu, the files that hold GPU tests -> gpu-tests.txt
#   qwen35-fallback  (cap 50 s) the same shape, 2 batches, transformers' pure-torch delta rule
#   dense            (cap 50 s) the Qwen3-8B shape of the earlier runs (36 layers, 5 captured)
#   qwen35-compile   (cap 80 s) qwen35-fla's run with each decoder layer torch.compile'd
#   attn             (cap 30 s, only when flash-attn imports) sdpa vs flash_attention_2
# Every benchmark line is a JSON object printed as soon as it is measured, so a step killed by
# its timeout keeps what it had measured. Files in $OUT (8 come back at most): env.txt, bench.log
# (the steps' stderr, limits, exits, skips), gpu-tests.txt, and one .jsonl per benchmark step.
# docs/performance/device-check.md ("The device check") says what each line means.
#
# STEPS=name,name runs only those (after the install). HSX_DEVICE_REHEARSAL=1 is the rehearsal
# (tests/test_device_rehearsal.py, on a CPU): every step up to its first CUDA call: the install
# and check, the GPU tests collected (each skips), each benchmark with --smoke (tiny shapes).
set -uo pipefail
OUT=${OUT:-/tmp/hsx-device-out}; mkdir -p "$OUT"
SITE=${HSX_DEVICE_SITE:-/tmp/hsx-site}
# The spool on the machine's disk: /tmp, unless /tmp is itself a tmpfs (then the checkout's disk).
DISK_SPOOL=/tmp/hsx-bench-spool
[ "$(stat -f -c %T /tmp 2>/dev/null)" = tmpfs ] && DISK_SPOOL=$PWD/.hsx-bench-spool
DISK_SPOOL=${HSX_DISK_SPOOL:-$DISK_SPOOL}
TMPFS_SPOOL=${HSX_TMPFS_SPOOL:-/dev/shm/hsx-bench-spool}
STEPS=${STEPS:-all}
SMOKE=; [ -n "${HSX_DEVICE_REHEARSAL:-}" ] && SMOKE=--smoke
START=$(date +%s); BUDGET_S=${BUDGET_S:-450}
left() { echo $(( BUDGET_S - ($(date +%s) - START) )); }
# step NAME CAP_S NEED_S CMD...: runs CMD under timeout min(CAP_S, time left), or skips it when
# less than NEED_S is left or STEPS does not name it. Its own lines go to bench.log.
step() {
  local name=$1 cap=$2 need=$3; shift 3
  case ",$STEPS," in *",all,"*|*",$name,"*) ;; *) return 0 ;; esac
  [ -n "$SMOKE" ] && cap=$(( cap < 60 ? cap : 60 ))  # rehearsed, no step takes this long: a hang
  local rest; rest=$(left)
  if [ "$rest" -lt "$need" ]; then echo "== $name: skipped, ${rest}s left" >> "$OUT/bench.log"; return 0; fi
  local limit=$(( cap < rest ? cap : rest ))
  echo "== $name (limit ${limit}s, $(date +%T))" >> "$OUT/bench.log"
  timeout "$limit" "$@"
  echo "== $name: exit $? after $(( $(date +%s) - START ))s" >> "$OUT/bench.log"
}

shopt -s nullglob; wheels=(.whl/*.whl); shopt -u nullglob
[ ${#wheels[@]} -gt 0 ] || { echo "no wheels in .whl/: run make device-bundle here and carry .whl" | tee "$OUT/env.txt"; exit 1; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "${wheels[@]}" \
  > "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
# The installed hsx first: the checkout's own hsx/ folder (on sys.path as the current directory of
# `python -m`, or by pytest's pythonpath) would hide hsx.gpu_consumer and the other mapped
# packages. The checkout stays on the path after it, for devkit/ (not installed).
export PYTHONPATH="$SITE:$PWD" PYTHONSAFEPATH=1 PATH="$SITE/bin:$PATH" PYTHONUNBUFFERED=1
python3 bench/device_bundle.py check >> "$OUT/env.txt" 2>&1 || { cat "$OUT/env.txt"; exit 1; }
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tail -2
  python3 -c "import torch, transformers, sys; print(sys.version.split()[0], 'torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__)"
  for module in triton fla flash_attn causal_conv1d; do
    python3 -c "import $module; print('$module', $module.__version__)" 2>&1 | tail -1
  done
  mkdir -p "$DISK_SPOOL" "$TMPFS_SPOOL"; df -hT "$DISK_SPOOL" "$TMPFS_SPOOL" 2>&1
} >> "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

GPU="python3 bench/gpu.py $SMOKE"
Q35="$GPU --model qwen3_5 --depth 24 --batches 4"
SPOOLS="--spool $DISK_SPOOL --spool $TMPFS_SPOOL"
step qwen35-fla 160 90 $Q35 --repeats 2 $SPOOLS >> "$OUT/qwen35-fla.jsonl" 2>> "$OUT/bench.log"
# -o pythonpath=: pytest's own setting puts the checkout first on sys.path (see PYTHONPATH above).
# -v: a result line per test as it ends, kept if the cap cuts the run short.
# Only the files that hold GPU tests: collecting all of tests/ imports what every test needs
# (minutes on a loaded machine, and packages the image lacks).
GPU_TEST_FILES=$(grep -l 'pytest.mark.gpu' tests/test_*.py)
step gpu-tests 90 40 python3 -m pytest -m gpu $GPU_TEST_FILES -v -p no:cacheprovider -o pythonpath= -rfEs \
  >> "$OUT/gpu-tests.txt" 2>&1
[ -f "$OUT/gpu-tests.txt" ] && tail -25 "$OUT/gpu-tests.txt"
step qwen35-fallback 50 40 $Q35 --kernels fallback --batches 2 --repeats 1 --spool "$TMPFS_SPOOL" \
  >> "$OUT/qwen35-fallback.jsonl" 2>> "$OUT/bench.log"
step dense 50 40 $GPU --batches 4 --repeats 1 $SPOOLS >> "$OUT/dense.jsonl" 2>> "$OUT/bench.log"
step qwen35-compile 80 60 $Q35 --compile --repeats 1 $SPOOLS >> "$OUT/qwen35-compile.jsonl" 2>> "$OUT/bench.log"
if python3 -c "import flash_attn" 2>/dev/null || [ -n "$SMOKE" ]; then
  step attn 30 20 $GPU --attn-compare --batches 4 --repeats 2 >> "$OUT/attn.jsonl" 2>> "$OUT/bench.log"
fi
# The figures that matter, one line per step (the .jsonl files have every pass).
python3 - "$OUT" <<'PY'
import json, pathlib, sys
for path in sorted(pathlib.Path(sys.argv[1]).glob("*.jsonl")):
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]
    kept = [line for line in lines if line.get("what") in ("summary", "projection", "compare", "skipped")]
    print(path.stem, json.dumps(kept) if kept else f"{len(lines)} lines, no summary (cut short?)")
PY
grep '^== ' "$OUT/bench.log"
echo "total $(( $(date +%s) - START ))s"
