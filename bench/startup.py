"""`hsx up` start-up against a bare process loading the same model (issue 25, item 4).

Side by side in one run, median of --repeats, each on a fresh workdir:

- `bare`: a new Python process that imports torch and transformers and loads the model
  (`AutoModelForCausalLM.from_pretrained`), the least any consumer can take;
- `up`: `hsx up --model M` from the command to the first consumer's `consumer_ready` (its model
  loaded and warmed up, about to take work): NATS started, the job produced, a consumer started;
- `up_demo` (with --demo): plain `hsx up`, which also builds its random model and dataset.

Prints one JSON object: seconds per run, medians, and `up / bare`, the issue's goal being <= 2.

    .venv/bin/python bench/startup.py --repeats 3 [--demo] [--samples 64]
"""

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BARE = """
import sys, torch, transformers
transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.bfloat16, local_files_only=True).eval()
"""


def bare_seconds(model: Path) -> float:
    started = time.monotonic()
    subprocess.run([sys.executable, "-c", BARE, str(model)], check=True, env=_env())
    return time.monotonic() - started


def up_seconds(workdir: Path, extra: list[str], *, timeout_s: float = 300.0) -> float:
    """From `hsx up` to the first consumer_ready in its consumer log; up is then stopped."""
    ready_log = workdir / "logs" / "consumer-0.log"
    started = time.monotonic()
    up = subprocess.Popen(
        [sys.executable, "-m", "hsx.cli", "up", "--workdir", str(workdir), *extra],
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        while time.monotonic() - started < timeout_s:
            if ready_log.exists() and b'"consumer_ready"' in ready_log.read_bytes():
                return time.monotonic() - started
            if up.poll() is not None:
                raise SystemExit(f"hsx up exited {up.returncode} before a consumer was ready ({workdir}/logs)")
            time.sleep(0.02)
        raise SystemExit(f"no consumer_ready within {timeout_s} s ({workdir}/logs)")
    finally:
        if up.poll() is None:
            os.killpg(up.pid, signal.SIGINT)
            try:
                up.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(up.pid, signal.SIGKILL)
                up.wait()


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")}
    return {**env, "PYTHONUNBUFFERED": "1"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--demo", action="store_true", help="also time plain hsx up (it builds its model)")
    args = parser.parse_args()

    from hsx.commands.embedded import build_tiny_model

    runs: dict[str, list[float]] = {"bare": [], "up": []} | ({"up_demo": []} if args.demo else {})
    with tempfile.TemporaryDirectory(prefix="hsx-startup-") as tmp:
        model = Path(tmp) / "model"
        build_tiny_model(model)
        bare_seconds(model)  # once, to warm the page cache for both
        for i in range(args.repeats):
            # Alternated, so that drift on a noisy machine falls on both alike.
            runs["bare"].append(bare_seconds(model))
            small = ["--samples", str(args.samples)]
            runs["up"].append(up_seconds(Path(tmp) / f"up-{i}", ["--model", str(model), *small]))
            if args.demo:
                runs["up_demo"].append(up_seconds(Path(tmp) / f"demo-{i}", small))
            print(json.dumps({name: round(seconds[-1], 2) for name, seconds in runs.items()}), file=sys.stderr)
    medians = {name: round(statistics.median(seconds), 2) for name, seconds in runs.items()}
    result = {
        "cores": os.cpu_count(),
        "repeats": args.repeats,
        "runs_s": {name: [round(s, 2) for s in seconds] for name, seconds in runs.items()},
        "median_s": medians,
        "up_over_bare": round(medians["up"] / medians["bare"], 2),
    }
    if args.demo:
        result["demo_over_bare"] = round(medians["up_demo"] / medians["bare"], 2)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
