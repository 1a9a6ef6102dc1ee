"""JobStream against the job it follows (issue 26), in one run over S3 (moto):

- `start`: `hsx up` (its NATS given, a demo model and dataset of --samples) and a trainer
  (`JobStream`, `shuffle_buffer=0`) started together: seconds from the start to the job's first
  upload (the first `uploaded` marker, as JetStream stamped it) and to the trainer's first batch.
- `while_running`: a second trainer started once half the plan has landed reads that backlog
  while the job goes on: its samples/s until it has caught up with what had landed; right after
  it, the job still running, HiddenStateDataset over the files landed by then (listed, as a
  running job has no index yet), the same way as `finished`: the baseline under the same load.
- `finished`: once the job is done, the stream over it (a new name each time: the markers
  replayed, the files read) against the reader a finished job is read with,
  `PrefetchedBatches(HiddenStateDataset, TokenBudgetSampler(shuffle=False))`, the same budget
  and reads in flight; alternated, --repeats times; samples/s from construction to the last batch.

Ratios are stream / HiddenStateDataset; the issue's goal is >= 0.9. On a CPU machine the
extraction's forward shares the cores with the readers, so the rate while the job runs is also
given against the finished job's reader.

    .venv/bin/python bench/stream.py [--samples 2000] [--repeats 3]

Prints one JSON object.
"""

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import nats

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.upload import _start_moto, isolate_aws  # noqa: E402
from hsx.commands.embedded import start_nats_server  # noqa: E402
from hsx.logs import configure_logging  # noqa: E402
from hsx.storage.reader import (  # noqa: E402
    HiddenStateDataset,
    JobStream,
    PrefetchedBatches,
    TokenBudgetSampler,
    pack_collate,
)
from hsx.wire import topology  # noqa: E402

JOB = "streambench"
BUDGET = 4096  # hsx up's own --token-budget
IN_FLIGHT = 16


class Trainer:
    """A stream read on a thread: when each batch came, and how many samples it held."""

    def __init__(self, stream: JobStream) -> None:
        self.stream, self.started = stream, time.monotonic()
        self.times: list[float] = []
        self.samples: list[int] = []
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.stream:
                self.times.append(time.monotonic())
                self.samples.append(len(batch["sample_index"]))
        except BaseException as exc:
            self.error = exc

    def seconds_to(self, count: int) -> float | None:
        """Seconds from its start to the batch that brought its `count`-th sample."""
        total = 0
        for stamp, size in zip(list(self.times), list(self.samples)):
            total += size
            if total >= count:
                return stamp - self.started
        return None

    def join(self, timeout: float) -> None:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise SystemExit(f"stream {self.stream.name} still reading after {timeout:.0f} s")
        if self.error is not None:
            raise self.error


def _stream(url: str, nats_url: str, name: str) -> JobStream:
    return JobStream(url, nats=nats_url, name=name, token_budget=BUDGET, shuffle_buffer=0, max_connections=IN_FLIGHT)


def dataset_batches(url: str) -> PrefetchedBatches:
    """The job's files as HiddenStateDataset reads them: a finished job through its index, a
    running one listed (its lengths then from the bundle's tokens), cut as the stream cuts them."""
    dataset = HiddenStateDataset(url, max_connections=IN_FLIGHT)
    lengths = dataset.sample_tokens
    if lengths is None:
        lengths = dataset.expected.lengths[dataset.sample_indices]
    sampler = TokenBudgetSampler(lengths, token_budget=BUDGET, shuffle=False)
    return PrefetchedBatches(dataset, sampler, collate_fn=pack_collate, in_flight=IN_FLIGHT)


def timed_pass(make_batches) -> tuple[float, int]:
    """(samples/s, samples) of one read, construction included."""
    started = time.monotonic()
    samples = sum(len(batch["sample_index"]) for batch in make_batches())
    return samples / (time.monotonic() - started), samples


def finished_pass(url: str, nats_url: str, which: str, number: int) -> tuple[float, int]:
    """One read of the finished job: the stream (a new name: markers replayed) or the dataset."""
    if which == "stream":
        return timed_pass(lambda: _stream(url, nats_url, f"replay-{number}"))
    return timed_pass(lambda: dataset_batches(url))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=1800.0)
    args = parser.parse_args()
    configure_logging(file=sys.stderr)  # stdout is the result's
    with tempfile.TemporaryDirectory(prefix="hsx-stream-bench-") as tmp:
        work = Path(tmp)
        isolate_aws(work)
        moto, endpoint = _start_moto(work / "moto.log")
        os.environ["AWS_ENDPOINT_URL"] = endpoint
        server = start_nats_server(work / "nats", log_file=work / "nats-server.log")
        up = None
        try:
            boto3.client("s3").create_bucket(Bucket="bench")
            url = f"s3://bench/out/{JOB}"
            env = {k: v for k, v in os.environ.items() if not k.startswith("HSX_")} | {"PYTHONUNBUFFERED": "1"}
            command = [sys.executable, "-m", "hsx.cli", "up", "--nats", server.url, "--workdir", str(work / "up")]
            command += ["--samples", str(args.samples), "--job", JOB, "--dest", "s3://bench/out"]
            started_wall, started = time.time(), time.monotonic()
            up = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            trainer = Trainer(_stream(url, server.url, "first"))
            late: Trainer | None = None
            backlog = 0
            landed_read: tuple[float, int] | None = None  # the dataset over what had landed, then
            while up.poll() is None:
                if time.monotonic() - started > args.timeout:
                    raise SystemExit(f"hsx up not done after {args.timeout:.0f} s ({work}/up/logs)")
                landed = sum(trainer.samples)
                if late is None and landed >= args.samples // 2:
                    backlog, late = landed, Trainer(_stream(url, server.url, "late"))
                if late is not None and landed_read is None and late.seconds_to(backlog) is not None:
                    landed_read = timed_pass(
                        lambda: dataset_batches(url)
                    )  # right after, the job still running: the same load
                time.sleep(0.05)
            if up.returncode != 0:
                raise SystemExit(f"hsx up exited {up.returncode} ({work}/up/logs)")
            job_done_s = time.monotonic() - started
            trainer.join(args.timeout)
            if late is None:
                raise SystemExit("the job ended before half of it had landed in the first trainer")
            late.join(args.timeout)
            first_upload_s = first_marker_time(server.url) - started_wall
            caught_up_s = late.seconds_to(backlog)
            runs: dict[str, list[float]] = {"stream": [], "dataset": []}
            for number in range(args.repeats):
                for which in ("stream", "dataset"):
                    rate, samples = finished_pass(url, server.url, which, number)
                    if samples != args.samples:
                        raise SystemExit(f"{which} read {samples} samples of {args.samples}")
                    runs[which].append(rate)
                print(json.dumps({k: round(v[-1], 1) for k, v in runs.items()}), file=sys.stderr)
            ratios = [s / d for s, d in zip(runs["stream"], runs["dataset"])]
            medians = {k: round(statistics.median(v), 1) for k, v in runs.items()}
            dataset_rate = medians["dataset"]
            late_rate = backlog / caught_up_s if caught_up_s else None
            result = {
                "cores": os.cpu_count(),
                "samples": args.samples,
                "start": {
                    "first_upload_s": round(first_upload_s, 2),
                    "first_batch_s": round(trainer.times[0] - started, 2),
                    "first_batch_after_first_upload_s": round(trainer.times[0] - started - first_upload_s, 2),
                    "job_done_s": round(job_done_s, 1),
                    "all_samples_in_first_trainer": sum(trainer.samples),
                },
                "while_running": {
                    "backlog_samples": backlog,
                    "caught_up_s": None if caught_up_s is None else round(caught_up_s, 2),
                    "samples_per_s": None if late_rate is None else round(late_rate, 1),
                    "job_still_running_when_caught_up": caught_up_s is not None
                    and late.started + caught_up_s < started + job_done_s,
                    "over_finished_dataset": None if late_rate is None else round(late_rate / dataset_rate, 2),
                    "dataset_over_landed_samples_per_s": None if landed_read is None else round(landed_read[0], 1),
                    "dataset_over_landed_samples": None if landed_read is None else landed_read[1],
                    "over_dataset_while_running": None
                    if late_rate is None or landed_read is None
                    else round(late_rate / landed_read[0], 2),
                },
                "finished": {
                    "samples_per_s": {k: [round(r, 1) for r in v] for k, v in runs.items()},
                    "median_samples_per_s": medians,
                    "stream_over_dataset": round(statistics.median(ratios), 2),
                },
            }
            print(json.dumps(result, indent=1))
        finally:
            if up is not None and up.poll() is None:
                up.terminate()
                up.wait(60)
            server.process.terminate()
            server.process.wait(10)
            moto.terminate()
            moto.wait(10)
    return 0


def first_marker_time(nats_url: str) -> float:
    """The wall-clock time JetStream stored the job's first `uploaded` marker."""

    async def read() -> float:
        nc = await nats.connect(nats_url)
        try:
            js = nc.jetstream()
            sub = await js.subscribe(
                topology.marker_filter(JOB, "uploaded"), stream=topology.EVENTS_STREAM, ordered_consumer=True
            )
            msg = await sub.next_msg(timeout=10)
            await sub.unsubscribe()
            return msg.metadata.timestamp.timestamp()
        finally:
            await nc.close()

    return asyncio.run(read())


if __name__ == "__main__":
    sys.exit(main())
