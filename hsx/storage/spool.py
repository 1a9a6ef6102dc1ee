"""A node's spool: the local directory where finished sample files wait for upload.

Layout: `<spool>/<job>/<plan>/<shard>/<sample_index>.safetensors`, the destination key's shard
and name under a folder per plan (JobSpec.plan_tag). The plan's folder keeps apart the files of
two jobs that had the same name (one deleted, the next produced): where a file lies follows from
(job, plan, sample) alone, so the uploader derives it as it derives the destination key, never
from an event; the spool's use is measured per plan, so a deleted plan's leftovers never count
against the next one's high-water mark; and the leftovers are one folder to remove.

A consumer reads its plan's usage before every fetch: `SpoolMeter` keeps it as a running count
instead of walking the folder each time (a walk grows with the upload backlog).
"""

import os
import re
import shutil
import threading
import time
from pathlib import Path

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.storage.fsutil import free_bytes, human_bytes
from hsx.storage.layout import SampleFiles, relative_sample_key
from hsx.storage.samplefile import file_size

log = get_logger("hsx.spool")

# A plan's folder is named by its tag: 12 hex characters, never a shard's 5 digits.
_PLAN_FOLDER = re.compile(r"^[0-9a-f]{12}$")


# A file's header (600-800 bytes) spread over the tokens of a batch of the shortest samples.
_HEADER_BYTES_PER_TOKEN = 64


def batch_bytes(files: SampleFiles) -> int:
    """The most one batch of the job adds to a spool: its token budget of sample files in the
    job's encoding (the tensors laid out as the writer lays them out, and a header per short
    file); 0 for a job from before its spec recorded the hidden size."""
    spec = files.spec
    if not spec.hidden_size:
        return 0
    shapes = files.tensor_shapes(num_tokens=spec.token_budget, has_mask=True)
    return file_size(shapes, {}) + spec.token_budget * _HEADER_BYTES_PER_TOKEN


def warn_spool_room(spool: Path, files: SampleFiles, *, high_water: int) -> None:
    """Warn, before the consumer takes a batch, when its spool's disk cannot hold one batch of the
    job, counting this job's files there as room (its uploaders free it), or when the high-water
    mark is above that room: either way the disk fills before the consumer pauses, and each write
    then waits, retried, until something frees space (not refused: a spool full of other files at
    start is a state the consumer recovers from, tests/test_disk_full.py)."""
    spec = files.spec
    need = batch_bytes(files)
    _, held = spool_usage(spool, spec.job, spec.plan_tag)
    room = free_bytes(spool) + held
    if need and room < need:
        log.warning(
            "spool_short_of_room",
            spool=str(spool),
            room=human_bytes(room),
            one_batch=human_bytes(need),
            hint=f"--token-budget {spec.token_budget} tokens x {len(spec.layers)} layers x hidden "
            f"{spec.hidden_size} at {spec.dtype}; each write waits for space until something frees it",
        )
    elif high_water > room:
        log.warning(
            "spool_high_water_above_free_space",
            spool=str(spool),
            high_water=high_water,
            room=room,
            hint="the disk fills before the consumer pauses; it then retries each write until uploads free room",
        )


_JOB_FOLDER = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def plan_folder(spool: Path, job: str, plan: str) -> Path:
    """`<spool>/<job>/<plan>`. Only a job name and a plan tag of their own forms name a folder: a
    value read from NATS cannot lead a worker to write or remove anything outside its spool."""
    if not _JOB_FOLDER.match(job) or not _PLAN_FOLDER.match(plan):
        raise HsxError(f"refused to name a spool folder for job {job!r}, plan {plan!r}: not a job name and plan tag")
    return spool / job / plan


def spool_file(spool: Path, job: str, plan: str, sample_index: int) -> Path:
    """Where sample `sample_index` of the job's plan waits for upload."""
    return plan_folder(spool, job, plan) / relative_sample_key(job, sample_index)


def spool_usage(spool: Path, job: str, plan: str) -> tuple[int, int]:
    """(files, bytes) of the plan's finished files in the spool; temp files excluded."""
    return _usage(plan_folder(spool, job, plan))


def _usage(folder: Path, *, before_ns: int | None = None) -> tuple[int, int]:
    """(files, bytes) of the finished files under `folder`; with `before_ns`, only those last
    written before that time (time.time_ns())."""
    files = total = 0
    stack = [folder]
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except FileNotFoundError:
            continue
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.name.endswith(".safetensors") and not entry.name.startswith("."):
                try:
                    stat = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                if before_ns is None or stat.st_mtime_ns < before_ns:
                    total += stat.st_size
                    files += 1
    return files, total


class SpoolMeter:
    """The plan's finished files in the spool, (files, bytes), as a running count: `usage()` costs
    a lock, never a walk. The count is the last walk of the folder plus what this process wrote
    since that walk began (`add`); a thread walks again every few seconds (`every_s`, or ten times
    the last walk's duration if longer), which is how the files the uploaders (other processes)
    delete, and those other consumers on the same spool write, come into it.

    No drift: each walk replaces the count, keeping only this process's writes recorded after the
    walk began, and the walk counts only files last written before it began (their mtime), so
    that a file written during the walk is not counted twice; one written just before the walk
    and announced to `add` just after it is (a file or so, until the next walk). Between walks
    the count is high by what was uploaded since the last one, never low by what this process
    wrote: the consumer may pause a moment late to resume, never late to pause.
    """

    def __init__(self, folder: Path, *, every_s: float = 2.0) -> None:
        self.folder = folder
        self.every_s = every_s
        self._lock = threading.Lock()
        self._walked = (0, 0)
        self._since: list[tuple[int, int, int]] = []  # (time recorded, files, bytes) written since the walk began
        self.walks = 0  # walks done (a test reads it: none on the hot path)
        # When the last walk began (time.time()): what `usage()` says of the files this process
        # did not write is as of then.
        self.walked_at = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.walk()

    def start(self) -> "SpoolMeter":
        """Walk again every few seconds, on a thread of its own."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="hsx-spool-meter", daemon=True)
            self._thread.start()
        return self

    def add(self, files: int, nbytes: int) -> None:
        """This process changed the plan's files by `files` and `nbytes` (a file written: 1 and its
        size; one rewritten in place: 0 and the difference)."""
        with self._lock:
            self._since.append((time.time_ns(), files, nbytes))

    def usage(self) -> tuple[int, int]:
        files, total, _ = self.measured()
        return files, total

    def measured(self) -> tuple[int, int, float]:
        """(files, bytes, `walked_at`), read together: the count and the time it is as of."""
        with self._lock:
            (files, total), walked_at = self._walked, self.walked_at
            for _, added_files, added_bytes in self._since:
                files += added_files
                total += added_bytes
        return max(0, files), max(0, total), walked_at

    def walk(self) -> float:
        """Walk the folder now (off the hot path); returns how long it took."""
        began_ns, began = time.time_ns(), time.monotonic()
        walked = _usage(self.folder, before_ns=began_ns)
        with self._lock:
            self._walked, self.walked_at = walked, began_ns / 1e9
            self._since = [entry for entry in self._since if entry[0] >= began_ns]
            self.walks += 1
        return time.monotonic() - began

    def _run(self) -> None:
        pause = self.every_s
        while not self._stop.wait(pause):
            try:
                pause = max(self.every_s, 10 * self.walk())
            except OSError as exc:  # the spool's disk failing: the count stands, the writes will say
                log.warning("spool_walk_failed", folder=str(self.folder), error=str(exc))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def other_plans(spool: Path, job: str, plan: str) -> list[Path]:
    """The job name's plan folders in the spool that are not `plan`'s: what earlier jobs of the
    same name left (deleted with files still waiting). Folders of another shape are not touched."""
    try:
        entries = list(os.scandir(spool / job))
    except FileNotFoundError:
        return []
    return sorted(
        Path(entry.path)
        for entry in entries
        if entry.is_dir(follow_symlinks=False) and _PLAN_FOLDER.match(entry.name) and entry.name != plan
    )


def remove_plan_folder(folder: Path, *, reason: str) -> tuple[int, int]:
    """Remove a plan's folder and everything in it, saying so; (files, bytes) of the finished
    files it held."""
    files, used = _usage(folder)
    shutil.rmtree(folder, ignore_errors=True)
    if files:
        log.warning("spool_plan_removed", folder=str(folder), files=files, bytes=used, reason=reason)
    return files, used


def remove_stale_plans(spool: Path, spec: JobSpec) -> None:
    """Remove what earlier jobs of `spec.job`'s name left in the spool. Called by a worker that
    has just read `spec` as its job's current spec: those plans' work queues went with their jobs,
    so nothing will ever upload their files."""
    for folder in other_plans(spool, spec.job, spec.plan_tag):
        remove_plan_folder(
            folder, reason=f"left by an earlier job named {spec.job}; the job's plan is now {spec.plan_tag}"
        )
