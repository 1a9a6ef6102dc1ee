"""CPU benchmark: the producer's batch planner (hsx/packing.py), packing and planning time.

Lengths are `hsx.commands.embedded.synthetic_lengths` (lognormal, median 500, clipped to 4096 tokens).
Prints one JSON object with:
- packing efficiency (real tokens / computed padded tokens) of hsx's token-budgeted plan on
  --samples samples, for the `hsx up` default budget (4096), the `hsx produce` default (16384)
  and 32768, beside two baselines: fixed 32-sample batches in dataset order (what one-off scripts
  do), and fixed 32-sample batches after sorting by length (so the gain of the token budget itself
  shows), with the ratios hsx / baseline;
- planning time (median of --repeats) at 125k, 250k, 500k and 1M samples, with seconds per
  sample at each size; `per_sample_growth_1m_vs_125k` near 1.0 means planning grows linearly
  (the sort makes it n log n: `n_log_n_growth_1m_vs_125k` is what that alone predicts);
- the time `synthetic_lengths` itself takes for the largest size (not counted in planning);
- with --rounds R1,R2,...: the packing efficiency of planning each consecutive R rows on their own
  (a plan published in rounds, so that the first batches go out before the whole dataset is
  read), at each budget, and its ratio to one plan of all --samples (issue 25 item 5).

Run: python bench/packing.py [--samples 100000] [--repeats 3] [--planning-budget 16384]
     [--rounds 200000,50000,20000]  (e.g. --samples 914000: the seeds' job)
"""

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hsx.commands.embedded import synthetic_lengths  # noqa: E402
from hsx.packing import plan_batches  # noqa: E402

MEDIAN_LEN, MAX_LEN = 500, 4096
FIXED_BATCH_SIZE = 32
BUDGETS = {"hsx_up_default": 4096, "hsx_produce_default": 16384, "large": 32768}
PLANNING_SIZES = (125_000, 250_000, 500_000, 1_000_000)


def fixed_batches_padded_tokens(lengths: list[int], batch_size: int) -> int:
    """Padded tokens of consecutive `batch_size` chunks, each padded to its longest sample."""
    return sum(
        len(chunk) * max(chunk) for chunk in (lengths[i : i + batch_size] for i in range(0, len(lengths), batch_size))
    )


def median_seconds(fn, repeats: int) -> tuple[float, list[float]]:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), times


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=100_000, help="samples for the packing efficiency figures")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--planning-budget", type=int, default=BUDGETS["hsx_produce_default"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", default="", help="rows per planning round, comma-separated")
    parser.add_argument("--rounds-budgets", default="16384,65536", help="token budgets for --rounds")
    args = parser.parse_args()

    # The producer hands the planner a list of ints (producer/main.py), so the benchmark does too.
    lengths = synthetic_lengths(args.samples, median=MEDIAN_LEN, max_len=MAX_LEN, seed=args.seed).tolist()
    real_tokens = sum(lengths)
    fixed_in_order = real_tokens / fixed_batches_padded_tokens(lengths, FIXED_BATCH_SIZE)
    fixed_sorted = real_tokens / fixed_batches_padded_tokens(sorted(lengths, reverse=True), FIXED_BATCH_SIZE)
    packing = {}
    for name, budget in BUDGETS.items():
        plan = plan_batches(lengths, token_budget=budget)
        efficiency = real_tokens / sum(b.padded_tokens for b in plan)
        packing[name] = {
            "token_budget": budget,
            "batches": len(plan),
            "efficiency": round(efficiency, 4),
            "ratio_vs_fixed32_in_order": round(efficiency / fixed_in_order, 3),
            "ratio_vs_fixed32_sorted": round(efficiency / fixed_sorted, 3),
        }

    rounds = {}
    for budget in [int(b) for b in args.rounds_budgets.split(",")] if args.rounds else []:
        whole = real_tokens / sum(b.padded_tokens for b in plan_batches(lengths, token_budget=budget))
        per_round = {"all": round(whole, 4)}
        for size in [int(r) for r in args.rounds.split(",")]:
            padded = sum(
                b.padded_tokens
                for start in range(0, len(lengths), size)
                for b in plan_batches(lengths[start : start + size], token_budget=budget)
            )
            per_round[str(size)] = {
                "efficiency": round(real_tokens / padded, 4),
                "vs_all": round(real_tokens / padded / whole, 4),
            }
        rounds[str(budget)] = per_round

    planning = {}
    for size in PLANNING_SIZES:
        size_lengths = synthetic_lengths(size, median=MEDIAN_LEN, max_len=MAX_LEN, seed=args.seed).tolist()
        seconds, raw = median_seconds(
            lambda: plan_batches(size_lengths, token_budget=args.planning_budget), args.repeats
        )
        planning[str(size)] = {
            "seconds": round(seconds, 3),
            "us_per_sample": round(seconds / size * 1e6, 3),
            "raw_seconds": [round(t, 3) for t in raw],
        }
    smallest, largest = planning[str(PLANNING_SIZES[0])], planning[str(PLANNING_SIZES[-1])]
    lengths_s, _ = median_seconds(
        lambda: synthetic_lengths(PLANNING_SIZES[-1], median=MEDIAN_LEN, max_len=MAX_LEN, seed=args.seed), args.repeats
    )

    out = {
        "lengths": {"distribution": "lognormal", "median": MEDIAN_LEN, "max_len": MAX_LEN, "seed": args.seed},
        "samples": args.samples,
        "real_tokens": real_tokens,
        "fixed32_in_order_efficiency": round(fixed_in_order, 4),
        "fixed32_sorted_efficiency": round(fixed_sorted, 4),
        "hsx_packing": packing,
        "packing_target": 0.97,
        "planning_token_budget": args.planning_budget,
        "planning": planning,
        "planning_1m_s": largest["seconds"],
        "planning_target_s": 30,
        "per_sample_growth_1m_vs_125k": round(largest["us_per_sample"] / smallest["us_per_sample"], 3),
        "n_log_n_growth_1m_vs_125k": round(math.log(PLANNING_SIZES[-1]) / math.log(PLANNING_SIZES[0]), 3),
        "synthetic_lengths_1m_s": round(lengths_s, 3),
        "repeats": args.repeats,
        **({"rounds": rounds} if rounds else {}),
    }
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
