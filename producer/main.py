"""`hsx produce`: the command's entry (`run`) and its dry run. A run reads the model's facts,
resolves `--layers` once into the job's layers, connects to NATS and hands the job to
producer/publishing.py (`produce`: dataset or stored samples -> plan -> checks -> spec in KV ->
one descriptor per batch, a round at a time -> bundle). With --dry-run it stops after planning:
the inputs read and planned as a run would, the descriptors checked against --max-payload, the
job sized (producer/estimate.py) and printed, with no NATS server and nothing published, stored
or written. SIGTERM or Ctrl-C stops it where it is (exit 75, STOPPED): what it published stays,
and a rerun resumes. Re-runs, replacement and resume: docs/architecture/producer.md."""

import asyncio
import contextlib
import signal
import time

import structlog

from hsx.errors import Unavailable
from hsx.exitcodes import DONE, STOPPED
from hsx.job import Layer
from hsx.model.layers import resolve_layers
from hsx.model.modelinfo import ModelInfo, load_model_info
from hsx.producer import preflight
from hsx.producer.config import ProducerConfig
from hsx.producer.draft import Draft
from hsx.producer.estimate import format_estimate
from hsx.producer.measure import Measure, NotMeasured
from hsx.producer.planning import Plan
from hsx.producer.publishing import produce
from hsx.producer.rounds import read_inputs
from hsx.storage.layout import SampleFiles
from hsx.storage.tokens import SampleTable
from hsx.wire.lifecycle import exit_now
from hsx.wire.natsconn import NATS_OUTAGE_ERRORS, OUTAGE_RETRY_S, close_connection, connect, redact_url

log = structlog.get_logger("hsx.producer")

# nats-server's max_payload unless its configuration says otherwise: what --dry-run checks
# descriptors against without a server to ask.
DEFAULT_MAX_PAYLOAD = 1 << 20


async def run(cfg: ProducerConfig, *, measure: Measure | None = None) -> int:
    """`measure`: how a dry run measures a compressed job's states (hsx/commands/measure.py).
    DONE once every batch is published (or the dry run printed); STOPPED when SIGTERM or SIGINT
    stopped it first (`_stopped_by_signals`)."""
    with _stopped_by_signals() as stopped:
        try:
            return await _run(cfg, measure=measure)
        except asyncio.CancelledError:
            if not stopped:
                raise
    # Everything published stays published and a rerun publishes only what is neither queued nor
    # done, so the job is safe to produce again; no `stopped` is recorded in its spec (that would
    # end it failed once what was published has run).
    log.warning(
        "producer_stopped",
        job=cfg.job,
        signal=signal.Signals(stopped[0]).name,
        then="run hsx produce again with the same settings: it resumes, publishing nothing twice",
    )
    return STOPPED


@contextlib.contextmanager
def _stopped_by_signals():
    """The first SIGTERM or SIGINT cancels the running task (its `finally` blocks close the
    connection and the spill files); a second ends the process at once, STOPPED. Yields the
    signals received."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    received: list[int] = []

    def on_signal(signum: int) -> None:
        received.append(signum)
        if len(received) == 1:
            log.info("stopping", signal=signal.Signals(signum).name, then="a second signal stops now")
            task.cancel()
        else:
            exit_now(STOPPED)

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield received
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)


async def _run(cfg: ProducerConfig, *, measure: Measure | None) -> int:
    started = time.monotonic()
    info = load_model_info(cfg.model, trust_remote_code=cfg.trust_remote_code)
    layers = resolve_layers(cfg.layers, info.num_layers, model=cfg.model)
    if cfg.dry_run:
        return await _dry_run(cfg, info, layers, measure)
    # Reach NATS first: an unreachable server is reported at once, not after reading a big dataset.
    nc = await connect(cfg.nats, name=f"hsx-producer-{cfg.job}")
    try:
        return await produce(cfg, nc, info, layers, started=started)
    except NATS_OUTAGE_ERRORS as exc:
        # Each step rides out an outage for OUTAGE_RETRY_S (through_outage); past that, one line.
        raise Unavailable(
            f"NATS at {redact_url(cfg.nats.url)} did not answer for {OUTAGE_RETRY_S:g} s "
            f"({type(exc).__name__}: {exc or 'no reply'}); job {cfg.job} is not fully published: run hsx "
            "produce again once NATS is back, and it resumes (nothing published is published twice)"
        ) from None
    finally:
        await close_connection(nc)


async def _dry_run(cfg: ProducerConfig, info: ModelInfo, layers: list[Layer], measure: Measure | None) -> int:
    """`--dry-run`: the inputs read and planned as a run would, the plan's descriptors checked
    against --max-payload, the job sized and printed. No NATS: nothing is published, stored,
    claimed or written."""
    starts: list[int] = []
    inputs = await asyncio.to_thread(read_inputs, cfg, info, on_round=lambda cut: starts.append(cut.first_sample))
    rows = inputs.samples
    try:
        plan = await asyncio.to_thread(Plan.of_samples, cfg, layers, rows, round_starts=starts)
        plan.log_ready(rows, from_store=False)
        max_payload = cfg.max_payload or DEFAULT_MAX_PAYLOAD
        await asyncio.to_thread(
            preflight.check_payloads,
            plan.descriptors(range(len(plan.batches)), rows),
            max_payload=max_payload,
            token_budget=cfg.token_budget,
            max_seq_len=cfg.max_seq_len,
        )
        draft = Draft(cfg, info, layers)
        estimate = await asyncio.to_thread(
            draft.estimate, plan, rows, inputs, None, max_payload=max_payload, measure=measure or _no_measure
        )
    finally:
        rows.close()
    print(format_estimate(estimate, as_json=cfg.as_json), flush=True)
    return DONE


def _no_measure(files: SampleFiles, rows: SampleTable, device: str):
    raise NotMeasured("this producer was started without a measurement (hsx produce hands it one)")
