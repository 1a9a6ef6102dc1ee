"""A trainer process for tests/test_jobstream.py: it follows a job with `JobStream` and, after
each batch, appends one line to its journal: the batch's sample indices and the stream's state
as it stands after that batch (the checkpoint a real trainer would write with its weights).
Started again with the same journal, it resumes from the last line's state. `--pause-after N`
sleeps after N batches, so a test can kill it there.

python tests/stream_trainer.py JOB_URL JOURNAL --nats URL [--name N] [--rank R --num-replicas W]
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

from hsx.storage.reader import JobStream


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("journal", type=Path)
    parser.add_argument("--nats", required=True)
    parser.add_argument("--name", default="trainer")
    parser.add_argument("--token-budget", type=int, default=256)
    parser.add_argument("--shuffle-buffer", type=int, default=8)
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--num-replicas", type=int, default=1)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--pause-after", type=int, default=0)
    parser.add_argument("--seconds-per-batch", type=float, default=0.0)
    args = parser.parse_args()
    stream = JobStream(
        args.url,
        nats=args.nats,
        name=args.name,
        token_budget=args.token_budget,
        shuffle_buffer=args.shuffle_buffer,
        num_replicas=args.num_replicas,
        rank=args.rank,
        concat_layers=True,
    )
    lines = args.journal.read_text().splitlines() if args.journal.exists() else []
    start_epoch = 0
    if lines:
        state = json.loads(lines[-1])["state"]
        stream.load_state_dict(state)
        start_epoch = state["epoch"]
    batches = 0
    with args.journal.open("a") as journal:
        for epoch in range(start_epoch, args.epochs):
            stream.set_epoch(epoch)
            for batch in stream:
                time.sleep(args.seconds_per_batch)
                # The "training step": the batch's shapes must be the collated ones.
                assert batch["hidden_states"].shape[0] == batch["input_ids"].shape[0]
                record = {
                    "epoch": epoch,
                    "samples": batch["sample_index"].tolist(),
                    "tokens": int(batch["input_ids"].shape[0]),
                    "state": stream.state_dict(),
                }
                journal.write(json.dumps(record) + "\n")
                journal.flush()
                os.fsync(journal.fileno())
                batches += 1
                if batches == args.pause_after:
                    print("paused", flush=True)
                    time.sleep(3600)
    print(json.dumps({"missing": stream.missing, "missing_count": stream.missing_count}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
