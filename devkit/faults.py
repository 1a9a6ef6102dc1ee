"""Faults that tests inject into the hsx processes they start; the product only has the seams.

A test names the faults in the environment of the process (`faults_env(...)`): the switches below,
and a PYTHONPATH that puts devkit/inject/sitecustomize.py first, which Python imports at start-up.
It calls `install`, which sets each named fault into its seam once the module that has the seam
is imported (an import hook, so an uploader never imports the consumer's torch modules for it).

- HSX_TEST_OOM_ABOVE_TOKENS=N: a forward of more than N padded tokens raises torch's
  out-of-memory error, so the split path runs on a CPU machine.
- HSX_TEST_DEVICE_ERROR_SAMPLE=I: a forward holding sample I raises torch's AcceleratorError, as
  a device-side assert or an illegal address would (the CUDA context is dead after one).
- HSX_TEST_FAIL_SAMPLE=I: a forward holding sample I raises an ordinary IndexError, as an
  embedding given a token id past its table does: a sample of the plan that fails on its own on
  every delivery (a poison sample), while the device stays usable.
- HSX_TEST_HANG_SAMPLE=I with HSX_TEST_HANG_MARKER=PATH: the first forward holding sample I (the
  one that creates PATH) hangs, as a wedged device would, until PATH.release exists; forwards
  that find PATH there already run normally.
- HSX_TEST_HANG_WRITE_SAMPLE=I with HSX_TEST_HANG_WRITE_MARKER=PATH: the first spool write of
  sample I's file (the one that creates PATH) hangs, as a dead disk or a hung network file system
  would, until PATH.release exists; writes that find PATH there already run normally.
- HSX_TEST_CRASH_ON_SAMPLE=I: a consumer kills itself (SIGKILL) when it takes up a batch holding
  sample I, as a batch that takes its process down every time would (host OOM killer, segfault).
- HSX_TEST_CRASH_BEFORE_ACK=PATH: the first consumer to write and announce a batch creates PATH
  and kills itself before acking (a crash at the worst moment); later ones see PATH and run on.
- HSX_TEST_HOLD_DEAD_LETTER=DIR: before storing a dead letter the process creates DIR/holding and
  waits until DIR/release appears.
- HSX_TEST_HOLD_PUBLISH=DIR: before a producer publishes its first batch it creates DIR/holding
  and waits until DIR/release appears (a producer stopped mid-run, its spec recorded).
- HSX_TEST_MISSING_MODULE=NAME: importing module NAME raises ModuleNotFoundError, as a module
  left out of an install would (a service that dies at its start while the others work).
"""

import asyncio
import importlib.abc
import importlib.machinery
import os
import signal
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import structlog

INJECT_DIR = Path(__file__).resolve().parent / "inject"
REPO = Path(__file__).resolve().parent.parent
SWITCHES = (
    "HSX_TEST_OOM_ABOVE_TOKENS",
    "HSX_TEST_DEVICE_ERROR_SAMPLE",
    "HSX_TEST_FAIL_SAMPLE",
    "HSX_TEST_HANG_SAMPLE",
    "HSX_TEST_HANG_MARKER",
    "HSX_TEST_HANG_WRITE_SAMPLE",
    "HSX_TEST_HANG_WRITE_MARKER",
    "HSX_TEST_CRASH_ON_SAMPLE",
    "HSX_TEST_CRASH_BEFORE_ACK",
    "HSX_TEST_HOLD_DEAD_LETTER",
    "HSX_TEST_MISSING_MODULE",
    "HSX_TEST_HOLD_PUBLISH",
)


def faults_env(environ: Mapping[str, str] | None = None, **switches: str) -> dict[str, str]:
    """`environ` (default: this process's) with the switches set and the injector on PYTHONPATH."""
    unknown = set(switches) - set(SWITCHES)
    if unknown:
        raise ValueError(f"unknown fault switches: {sorted(unknown)}")
    env = dict(os.environ if environ is None else environ)
    env.update(switches)
    path = [str(INJECT_DIR), str(REPO), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))
    return env


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _first_to_create(path: str) -> bool:
    try:
        Path(path).touch(exist_ok=False)
        return True
    except FileExistsError:
        return False


def oom_above(tokens: int) -> Callable:
    """A `gpu_consumer.extract.before_forward` that raises torch's out-of-memory error for any
    forward of more than `tokens` padded tokens (tests in this process set it with monkeypatch)."""

    def before_forward(samples, padded_tokens: int) -> None:
        import torch

        if padded_tokens > tokens:
            raise torch.OutOfMemoryError(f"test fault: {padded_tokens} padded tokens > {tokens}")

    return before_forward


def device_error_on(index: int) -> Callable:
    """A `gpu_consumer.extract.before_forward` that raises torch's AcceleratorError (what a CUDA
    device-side assert or illegal memory access raises) for any forward holding sample `index`."""

    def before_forward(samples, padded_tokens: int) -> None:
        import torch

        if any(sample.index == index for sample in samples):
            raise torch.AcceleratorError(f"CUDA error: device-side assert triggered (test fault: sample {index})")

    return before_forward


def index_error_on(index: int) -> Callable:
    """A `gpu_consumer.extract.before_forward` that raises IndexError, with the text torch's
    embedding raises for a token id past its table, for any forward holding sample `index`."""

    def before_forward(samples, padded_tokens: int) -> None:
        if any(sample.index == index for sample in samples):
            raise IndexError(f"index out of range in self (test fault: sample {index})")

    return before_forward


class NonFiniteFault:
    """Writes `value` ("nan", "inf", "-inf") into the states of sample `index` at one token, as a
    model whose activations overflow would. `hook` goes on a decoder layer
    (`register_forward_hook`): the value then reaches every later layer's states of that sample,
    and of no other. `before_forward` is gpu_consumer.extract's seam: it tells the hook which row
    of the batch holds the sample."""

    def __init__(self, index: int, value: str, *, token: int = 1) -> None:
        self.index, self.value, self.token = index, float(value), token
        self.row: int | None = None

    def before_forward(self, samples, padded_tokens: int) -> None:
        self.row = next((row for row, sample in enumerate(samples) if sample.index == self.index), None)

    def hook(self, _module, _args, output) -> None:
        hidden = output[0] if isinstance(output, tuple) else output
        if self.row is not None:
            hidden[self.row, self.token] = self.value


def _consumer_extract(module, environ: Mapping[str, str]) -> None:
    oom_limit = int(environ.get("HSX_TEST_OOM_ABOVE_TOKENS") or 0)
    device_error, fail_sample = environ.get("HSX_TEST_DEVICE_ERROR_SAMPLE"), environ.get("HSX_TEST_FAIL_SAMPLE")
    hang_sample, hang_marker = environ.get("HSX_TEST_HANG_SAMPLE"), environ.get("HSX_TEST_HANG_MARKER", "")
    if not (oom_limit or device_error or fail_sample or hang_sample):
        return
    faults = [
        *([oom_above(oom_limit)] if oom_limit else []),
        *([device_error_on(int(device_error))] if device_error else []),
        *([index_error_on(int(fail_sample))] if fail_sample else []),
    ]

    def before_forward(samples, padded_tokens: int) -> None:
        for fault in faults:
            fault(samples, padded_tokens)
        if hang_sample and any(str(s.index) == hang_sample for s in samples) and _first_to_create(hang_marker):
            module.log.warning("test_forward_hanging", sample=int(hang_sample), until=f"{hang_marker}.release")
            _wait_for_release(hang_marker)

    module.before_forward = before_forward


def _wait_for_release(marker: str) -> None:
    while not Path(f"{marker}.release").exists():
        time.sleep(0.1)


def _consumer_writer(module, environ: Mapping[str, str]) -> None:
    """The spool write of one sample hangs. The writer has no seam of its own: the file write
    it calls (hsx.storage.samplefile.write, as this module sees it) is wrapped."""
    sample, marker = environ.get("HSX_TEST_HANG_WRITE_SAMPLE"), environ.get("HSX_TEST_HANG_WRITE_MARKER", "")
    if not sample:
        return
    files = module.samplefile

    class _HangingWrites:
        def __getattr__(self, name):
            return getattr(files, name)

        @staticmethod
        def write(final, tensors, metadata, **kwargs):
            if metadata.get("sample_index") == sample and _first_to_create(marker):
                structlog.get_logger("hsx.test").warning(
                    "test_write_hanging", sample=int(sample), until=f"{marker}.release"
                )
                _wait_for_release(marker)
            return files.write(final, tensors, metadata, **kwargs)

    module.samplefile = _HangingWrites()


def _consumer_service(module, environ: Mapping[str, str]) -> None:
    crash_on, crash_marker = environ.get("HSX_TEST_CRASH_ON_SAMPLE"), environ.get("HSX_TEST_CRASH_BEFORE_ACK")
    if crash_on:

        def on_batch(batch) -> None:
            if any(str(sample.index) == crash_on for sample in batch.samples):
                _kill_self()

        module.on_batch = on_batch
    if crash_marker:

        def before_ack() -> None:
            if _first_to_create(crash_marker):
                _kill_self()

        module.before_ack = before_ack


def _dead_letters(module, environ: Mapping[str, str]) -> None:
    hold = environ.get("HSX_TEST_HOLD_DEAD_LETTER")
    if not hold:
        return

    async def before_store() -> None:
        Path(hold, "holding").touch()
        while not Path(hold, "release").exists():
            await asyncio.sleep(0.05)

    module.before_store = before_store


def _producer(module, environ: Mapping[str, str]) -> None:
    """The producer has no seam of its own: its publishing function is wrapped."""
    hold = environ.get("HSX_TEST_HOLD_PUBLISH")
    if not hold:
        return
    publish = module.publish_batches

    async def held(*args, **kwargs):
        if _first_to_create(str(Path(hold, "holding"))):
            while not Path(hold, "release").exists():
                await asyncio.sleep(0.05)
        return await publish(*args, **kwargs)

    module.publish_batches = held


_SEAMS: dict[str, Callable] = {
    "hsx.gpu_consumer.extract": _consumer_extract,
    "hsx.gpu_consumer.service": _consumer_service,
    "hsx.gpu_consumer.writer": _consumer_writer,
    "hsx.wire.deadletter": _dead_letters,
    "hsx.producer.publishing": _producer,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Lets each seam's module load as usual, then sets its faults."""

    def __init__(self, environ: Mapping[str, str]) -> None:
        self.environ = dict(environ)

    def find_spec(self, name, path, target=None):
        if name == self.environ.get("HSX_TEST_MISSING_MODULE"):
            raise ModuleNotFoundError(f"No module named {name!r} (test fault)", name=name)
        if name not in _SEAMS:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return None
        loader, environ = spec.loader, self.environ
        original = loader.exec_module

        def exec_module(module) -> None:
            original(module)
            _SEAMS[name](module, environ)

        loader.exec_module = exec_module
        return spec


def install(environ: Mapping[str, str]) -> None:
    if any(environ.get(switch) for switch in SWITCHES):
        sys.meta_path.insert(0, _AfterImport(environ))
