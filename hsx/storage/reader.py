"""Reading a finished job's sample files back: `load_sample` (one file's bytes to tensors and
metadata), `dequantize` (float8), `HiddenStateDataset` (a random-access torch Dataset over a job's
folder: `file:///out/myjob`, `s3://bucket/prefix/myjob` or a plain path; every file checked
against the job's bundle first, `on_bad_file` for one that fails), and for a training loop of
one's own `TokenBudgetSampler`, `pad_collate`, `pack_collate`, `prefetched` and
`PrefetchedBatches`; and `JobStream`, the same items of a job while it still runs, learnt from
its NATS events (hsx/wire/landed.py; batches cut and dealt by hsx/storage/streambatches.py). It
knows nothing of how the files were made.

How to use them: docs/reference/data.md, "Reading the output in your own loop", and docs/training.md;
notes in docs/architecture/storage.md.
"""

from __future__ import annotations

import array
import dataclasses
import math
import os
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice
from typing import Any

import numpy as np
import torch
from safetensors.torch import load as _load_safetensors

from hsx.errors import HsxError
from hsx.job import JobSpec
from hsx.logs import get_logger
from hsx.packing import plan_batches, shuffled_epoch
from hsx.storage import encodings
from hsx.storage.destinations import Destination
from hsx.storage.expected import (
    BUNDLE_SPEC_KEY,
    ExpectedSamples,
    describe,
    is_missing,
    load_expected,
    mismatches,
    read_metadata,
)
from hsx.storage.index import bundle_spec, stored_samples
from hsx.storage.layout import relative_sample_key
from hsx.storage.location import Location, open_destination
from hsx.storage.sampledigest import file_digest
from hsx.storage.samplefile import SampleFileCorrupt
from hsx.storage.streambatches import LandingBatcher, check_rank, deal, shuffled_batches
from hsx.wire.landed import EpochEnd, Landed, LandingFeed, read_job_spec_waiting

log = get_logger("hsx.data")


ON_BAD_FILE = ("raise", "skip")


class BadSampleFile(HsxError):
    """A sample file the dataset will not yield: missing, damaged, or not this job's sample (one
    line naming its key and what is wrong)."""


def load_sample(data: bytes) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """One sample file's bytes -> (tensors, metadata), the hidden states decoded by the file's
    encoding (hsx/storage/encodings/: decompressed; float8 stays float8 with its scales, see
    `dequantize`); SampleFileCorrupt if it does not load, UnknownEncoding (one) if its encoding
    is none this hsx has."""
    metadata = read_metadata(data)
    try:
        tensors = _load_safetensors(data)
    except Exception as exc:  # safetensors raises SafetensorError, ValueError, ... for damaged files
        raise SampleFileCorrupt(f"safetensors cannot load it ({type(exc).__name__}: {exc})") from None
    return encodings.of_file(metadata, tensors).decode(tensors, metadata), metadata


def dequantize(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> torch.Tensor:
    """The real hidden states of a loaded file's tensors (`load_sample`), as the file's encoding
    (named in `metadata`) says: for float8 (a `hidden_states_scale` tensor [T, k] beside float8
    `hidden_states` [T, k, H]) `hidden_states.float() * scale[..., None]` in float32; for any
    other `hidden_states` unchanged. Without `metadata`, float8 is known by its scale tensor."""
    return encodings.of_file(metadata or {}, tensors).values(tensors)


class HiddenStateDataset(torch.utils.data.Dataset):
    """Random access over one job's sample files, in sample-index order.

    `dataset[i]` is a dict: `hidden_states` [T, k, H] (or [T, k*H] with `concat_layers=True`, the
    DFlash concatenated feature), `input_ids` [T], `loss_mask` [T] when the file has one,
    `sample_index`, `metadata`. Float8 files are dequantized to float32 unless `dequantize=False`,
    which returns the raw float8 tensor and `hidden_states_scale` [T, k]. A folder with no sample
    files is an error (a mistyped URL must not read as an empty dataset).

    `sample_tokens` holds each sample's token count when the job's index was read (for length
    grouping without opening a file), else None.

    Only the samples of the job's current plan are the dataset's (those below its bundle's
    `total_samples`), and each file is checked before it is yielded against what the bundle says
    that sample is (hsx/storage/expected.py: job, plan, sample index, model, layers, dtype, shape
    [T, k, H], token count, and its input ids against the bundle's tokenized samples). For that the
    bundle's `tokens.arrow` is read once, here: one download (some 3 bytes a token) and about
    1.4 s of CPU per million samples plus 1.5 s per 100M tokens (11 s for 1M samples of 650
    tokens), kept as 24 bytes a sample. `check_input_ids=False` skips that download and
    compares the metadata, and the lengths when the index was read, only. A bundle whose
    `total_samples` is not its tokens file's row count is refused here, in one line. A folder
    without a bundle (files copied by hand) is read with each file checked against its key and
    itself only.

    `on_bad_file`: what a missing file, a damaged one or one that is not this job's sample does.
    "raise" (the default): `BadSampleFile`, an HsxError of one line naming the key and what is
    wrong. "skip": `dataset[i]` is None, a `sample_file_skipped` warning names the key and why,
    and `pad_collate`, `pack_collate`, `prefetched` and `PrefetchedBatches` leave it out (a batch
    whose every item was skipped collates to None, and PrefetchedBatches yields nothing for it).
    """

    def __init__(
        self,
        url: str | Location,
        *,
        concat_layers: bool = False,
        dequantize: bool = True,
        max_connections: int = 16,
        on_bad_file: str = "raise",
        check_input_ids: bool = True,
    ) -> None:
        if on_bad_file not in ON_BAD_FILE:
            raise HsxError(f"on_bad_file is {on_bad_file!r}, expected one of {', '.join(ON_BAD_FILE)}")
        self.location = Location.parse_job_folder(url, what="job folder")
        self.url, self.job = str(self.location), self.location.name
        self.concat_layers = concat_layers
        self.dequantize = dequantize
        self.max_connections = max_connections  # per process: what `prefetched` reads at once
        self.on_bad_file = on_bad_file
        # The opening client is dropped here: each process that reads opens its own.
        folder = open_destination(self.location, max_connections=4)
        spec = bundle_spec(folder)
        if spec is not None and spec.job != self.job:
            raise HsxError(f"{self.url}/{BUNDLE_SPEC_KEY} is job {spec.job}'s, not {self.job}'s")
        if spec is None:
            log.info("dataset_without_bundle", url=self.url, checked="each file against its key and itself")
            self.expected = ExpectedSamples(job=self.job)
        else:
            # Before the listing: the listing is bounded by total_samples, which this checks.
            self.expected = load_expected(
                folder, self.url, ExpectedSamples.of_bundle(spec, self.url), input_ids=check_input_ids
            )
        self.sample_indices, index, why_not = stored_samples(folder, self.job, spec=spec)
        self.sample_tokens: list[int] | None = None
        if index is not None:
            tokens = index.table.column("tokens").to_numpy()
            self.sample_tokens = tokens.tolist()
            if spec is not None and self.expected.lengths is None:
                self.expected = self.expected.with_lengths(tokens)  # complete: row i is sample i
        else:
            log.info("dataset_listing", url=self.url, reason=why_not)
        if not self.sample_indices:
            raise HsxError(f"{self.url}: no sample files of job {self.job} there")
        self._dest: Destination | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pid: int | None = None

    def __len__(self) -> int:
        return len(self.sample_indices)

    def _destination(self) -> Destination:
        if self._dest is None or self._pid != os.getpid():
            self._dest = open_destination(self.location, max_connections=self.max_connections)
            self._pool = None  # a forked child has the parent's pool object but none of its threads
            self._pid = os.getpid()
        return self._dest

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_dest"] = state["_pool"] = state["_pid"] = None
        return state

    def __getitems__(self, positions: Sequence[int]) -> list[dict[str, Any] | None]:
        """A DataLoader batch (`batch_size` or `batch_sampler`): its files read at once on up to
        `max_connections` threads of this process, so each worker process keeps that many GETs
        going instead of one at a time."""
        self._destination()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=self.max_connections, thread_name_prefix="hsx-batch")
        return list(self._pool.map(self.__getitem__, positions))

    def __getitem__(self, i: int) -> dict[str, Any] | None:
        if not -len(self) <= i < len(self):
            raise IndexError(f"index {i} out of range for {len(self)} samples")
        return _read_checked(
            self._destination(),
            self.url,
            self.expected,
            self.sample_indices[i],
            concat_layers=self.concat_layers,
            dequantized=self.dequantize,
            on_bad_file=self.on_bad_file,
            missing="no object at this key",
        )


class _NotTheSample(Exception):
    """Why a file read at a sample's key is not that sample (damaged, or another's)."""


def _checked_item(
    data: bytes,
    expected: ExpectedSamples,
    sample_index: int,
    *,
    concat_layers: bool,
    dequantized: bool,
    tokens: int | None = None,
    sample_digest: str = "",
) -> dict[str, Any]:
    """The dataset's item of the file `data` read at `sample_index`'s key, checked against
    `expected` (and against `tokens`, the sample's token count, and `sample_digest`, what the
    sample is, when known from its marker); _NotTheSample says why not."""
    try:
        # The header first: nothing is decoded (or allocated) from a file that is not the sample.
        failed = mismatches(data, expected, sample_index)
        if failed:
            raise _NotTheSample(f"not this job's sample {sample_index}: {describe(failed)}")
        tensors, metadata = load_sample(data)
    except SampleFileCorrupt as exc:
        raise _NotTheSample(f"damaged: {exc}") from None
    if tokens is not None and "input_ids" not in failed and len(tensors["input_ids"]) != tokens:
        failed["input_ids"] = f"{len(tensors['input_ids'])} input ids, its uploaded marker says {tokens} tokens"
    if sample_digest and not failed:
        found = file_digest(tensors["input_ids"].numpy(), _mask_of(tensors), str(metadata.get("source_id", "")))
        if found.hex() != sample_digest:
            failed["input_ids"] = "its tokens, mask or source id are not those its uploaded marker records"
    if failed:
        raise _NotTheSample(f"not this job's sample {sample_index}: {describe(failed)}")
    hidden = dequantize(tensors, metadata) if dequantized else tensors["hidden_states"]
    if concat_layers:
        hidden = hidden.reshape(hidden.shape[0], -1)
    item: dict[str, Any] = {
        "hidden_states": hidden,
        "input_ids": tensors["input_ids"],
        "sample_index": sample_index,
        "metadata": metadata,
    }
    if "loss_mask" in tensors:
        item["loss_mask"] = tensors["loss_mask"]
    if not dequantized and encodings.SCALE_TENSOR in tensors:
        item[encodings.SCALE_TENSOR] = tensors[encodings.SCALE_TENSOR]
    return item


def _mask_of(tensors: dict[str, torch.Tensor]):
    mask = tensors.get("loss_mask")
    return None if mask is None else mask.numpy()


def _read_checked(
    destination: Destination,
    url: str,
    expected: ExpectedSamples,
    sample_index: int,
    *,
    concat_layers: bool,
    dequantized: bool,
    on_bad_file: str,
    missing: str,
    tokens: int | None = None,
    sample_digest: str = "",
) -> dict[str, Any] | None:
    """Sample `sample_index`'s item read from the job folder `destination` (at `url`) and checked;
    a missing (`missing` says why it should not be), damaged or foreign file as `on_bad_file`
    says: BadSampleFile naming its key, or None and a `sample_file_skipped` warning."""
    key = relative_sample_key(expected.job, sample_index)
    try:
        data = destination.read_bytes(key)
        return _checked_item(
            data,
            expected,
            sample_index,
            concat_layers=concat_layers,
            dequantized=dequantized,
            tokens=tokens,
            sample_digest=sample_digest,
        )
    except _NotTheSample as exc:
        reason = str(exc)
    except Exception as exc:
        if not is_missing(exc):
            raise
        reason = f"missing: {missing}"
    if on_bad_file == "skip":
        log.warning("sample_file_skipped", key=f"{url}/{key}", sample_index=sample_index, reason=reason)
        return None
    raise BadSampleFile(f"{url}/{key}: {reason}")


class TokenBudgetSampler(torch.utils.data.Sampler):
    """Batches of dataset positions, each within `token_budget` padded tokens (batch size x its
    longest sample, and at most `max_batch_size` samples), cut as the producer cuts its plan
    (hsx/packing.py) from the lengths in the job's index: no file is opened to group them. With
    `shuffle`, each epoch (`set_epoch`, as DistributedSampler) draws which samples of equal length
    go together and the order of the batches from `seed` and the epoch; the batches' count does
    not change. For distributed training each of `num_replicas` ranks takes every
    `num_replicas`-th batch from `rank` (all ranks draw the same epoch from the same seed), and
    all take the same number. For `DataLoader(dataset, batch_sampler=sampler,
    collate_fn=pad_collate)` or `PrefetchedBatches(dataset, sampler)`."""

    def __init__(
        self,
        lengths: Sequence[int] | HiddenStateDataset,
        *,
        token_budget: int,
        max_batch_size: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
    ) -> None:
        check_rank(num_replicas, rank)
        if isinstance(lengths, HiddenStateDataset):
            if lengths.sample_tokens is None:
                raise HsxError(
                    f"{lengths.url}: the job has no complete index, so its samples' lengths are not known "
                    "without opening every file; run hsx index rebuild JOB_URL, or pass the lengths"
                )
            lengths = lengths.sample_tokens
        self.lengths = np.asarray(lengths, dtype=np.int64)
        longest = int(self.lengths.argmax()) if len(self.lengths) else 0
        if len(self.lengths) and self.lengths[longest] > token_budget:
            raise HsxError(
                f"sample at position {longest} has {self.lengths[longest]} tokens, more than the token budget "
                f"{token_budget}"
            )
        self.token_budget, self.max_batch_size = token_budget, max_batch_size
        self.shuffle, self.seed, self.epoch = shuffle, seed, 0
        self.num_replicas, self.rank = num_replicas, rank
        batches = len(self._batches(np.arange(len(self.lengths))))
        self._count = -(-batches // num_replicas)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def _batches(self, order: np.ndarray) -> list[list[int]]:
        planned = plan_batches(self.lengths[order], token_budget=self.token_budget, max_batch_size=self.max_batch_size)
        return [[int(order[i]) for i in batch.sample_indices] for batch in planned]

    def __iter__(self) -> Iterator[list[int]]:
        if self.shuffle:
            drawn = shuffled_epoch(
                self.lengths,
                token_budget=self.token_budget,
                max_batch_size=self.max_batch_size,
                seed=self.seed,
                epoch=self.epoch,
            )
            batches = [positions.tolist() for positions in drawn]
        else:
            batches = self._batches(np.arange(len(self.lengths)))
        # Every rank takes the same number of steps (a rank with one fewer would hang the others
        # at their next all-reduce), so the last round is filled from the epoch's first batches,
        # as DistributedSampler repeats samples.
        short = self._count * self.num_replicas - len(batches)
        batches += [batches[i % len(batches)] for i in range(short)]  # more ranks than batches: again
        yield from batches[self.rank :: self.num_replicas]

    def __len__(self) -> int:
        return self._count


def _batch_tensor(like: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialized tensor for a batch's hidden states. In a DataLoader worker it is made in
    shared memory, as torch's default_collate makes its output: the batch is then handed to the
    training process as it is, not copied into shared memory a second time when it is sent."""
    if torch.utils.data.get_worker_info() is None:
        return like.new_empty(shape)
    storage = like._typed_storage()._new_shared(math.prod(shape), device=like.device)
    return like.new(storage).resize_(shape)


def _loss_mask(item: dict[str, Any]) -> torch.Tensor:
    """A file without a loss mask had none in its dataset: every token counts."""
    mask = item.get("loss_mask")
    return torch.ones(len(item["input_ids"]), dtype=torch.uint8) if mask is None else mask


def pad_collate(items: list[dict[str, Any] | None], *, pad_token_id: int = 0) -> dict[str, Any] | None:
    """Items of HiddenStateDataset padded on the right to the longest: `hidden_states` [B, T, ...]
    (zeros after each sample), `input_ids` [B, T] (`pad_token_id` after), `attention_mask` and
    `loss_mask` [B, T] (0 after), `lengths` and `sample_index` [B]. Skipped items (None) are left
    out; None if every one was."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    lengths = [len(item["input_ids"]) for item in items]
    longest, first = max(lengths), items[0]["hidden_states"]
    hidden = _batch_tensor(first, (len(items), longest, *first.shape[1:]))
    input_ids = torch.full((len(items), longest), pad_token_id, dtype=torch.int64)
    attention = torch.zeros((len(items), longest), dtype=torch.int64)
    loss = torch.zeros((len(items), longest), dtype=torch.int64)
    for row, (item, length) in enumerate(zip(items, lengths)):
        hidden[row, :length] = item["hidden_states"]
        hidden[row, length:] = 0
        input_ids[row, :length] = item["input_ids"]
        attention[row, :length] = 1
        loss[row, :length] = _loss_mask(item)
    return {
        "hidden_states": hidden,
        "input_ids": input_ids,
        "attention_mask": attention,
        "loss_mask": loss,
        "lengths": torch.tensor(lengths, dtype=torch.int64),
        "sample_index": torch.tensor([item["sample_index"] for item in items], dtype=torch.int64),
    }


def pack_collate(items: list[dict[str, Any] | None]) -> dict[str, Any] | None:
    """Items of HiddenStateDataset packed end to end with no padding: `hidden_states` [N, ...],
    `input_ids`, `loss_mask`, `position_ids` (from 0 in each sample) [N], `cu_seqlens` [B + 1]
    int32 (each sample's start, as variable-length attention kernels take them), `sample_index` [B].
    Skipped items (None) are left out; None if every one was."""
    items = [item for item in items if item is not None]
    if not items:
        return None
    lengths = [len(item["input_ids"]) for item in items]
    hidden = [item["hidden_states"] for item in items]
    return {
        "hidden_states": torch.cat(hidden, out=_batch_tensor(hidden[0], (sum(lengths), *hidden[0].shape[1:]))),
        "input_ids": torch.cat([item["input_ids"].to(torch.int64) for item in items]),
        "loss_mask": torch.cat([_loss_mask(item).to(torch.int64) for item in items]),
        "position_ids": torch.cat([torch.arange(length) for length in lengths]),
        "cu_seqlens": torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32),
        "sample_index": torch.tensor([item["sample_index"] for item in items], dtype=torch.int64),
    }


def prefetched(
    dataset: HiddenStateDataset, positions: Iterable[int], *, in_flight: int = 16
) -> Iterator[dict[str, Any]]:
    """`dataset[i]` for each position, in order, with up to `in_flight` read ahead on threads of
    this process: an S3 read waits on the network, not on the interpreter, so one process keeps
    that many GETs going (a DataLoader's workers do it with processes instead); up to twice that
    many items are held. Items the dataset skipped (`on_bad_file="skip"`) are left out."""
    yield from (item for item in _read_ahead(dataset, positions, in_flight=in_flight) if item is not None)


def _read_ahead(dataset: HiddenStateDataset, positions: Iterable[int], *, in_flight: int) -> Iterator[Any]:
    dataset._destination()  # one client for every thread (boto3 clients are thread-safe)
    return ordered_map(dataset.__getitem__, positions, in_flight=in_flight)


class PrefetchedBatches(torch.utils.data.IterableDataset):
    """A batch sampler's batches of `dataset`, collated, with up to `in_flight` files read ahead
    on threads of the training process, across batch boundaries: over S3, where a sample's read
    waits on the network and its decoding is cheap, this keeps the GETs going without worker
    processes, whose batches cost one more copy through shared memory on their way
    (docs/bench-results/2026-12-02-reader.md, "Reader against plain boto3"). Iterate it, or hand it to `DataLoader(batches,
    batch_size=None)` (num_workers=0) for `pin_memory`. `set_epoch` reaches the sampler."""

    def __init__(
        self,
        dataset: HiddenStateDataset,
        batch_sampler: Iterable[list[int]],
        *,
        collate_fn: Callable[[list[dict[str, Any]]], Any] = pack_collate,
        in_flight: int = 16,
    ) -> None:
        self.dataset, self.batch_sampler = dataset, batch_sampler
        self.collate_fn, self.in_flight = collate_fn, in_flight

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.batch_sampler, "set_epoch"):
            self.batch_sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Any]:
        worker = torch.utils.data.get_worker_info()
        if worker is not None and worker.num_workers > 1:  # each worker would yield every batch
            raise HsxError(
                f"PrefetchedBatches reads ahead on threads: give it to a DataLoader with num_workers=0, "
                f"not {worker.num_workers}"
            )
        sizes: deque[int] = deque()

        def positions() -> Iterator[int]:
            for batch in self.batch_sampler:
                if batch:  # its size is queued before its first position is read ahead
                    sizes.append(len(batch))
                    yield from batch

        # Skipped items (None) keep their places here, so each batch is cut where the sampler cut
        # it; the collate function sees only the items that were read.
        items = _read_ahead(self.dataset, positions(), in_flight=self.in_flight)
        for first in items:
            batch = [item for item in (first, *islice(items, sizes.popleft() - 1)) if item is not None]
            if batch:
                yield self.collate_fn(batch)


def ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], *, in_flight: int) -> Iterator[Any]:
    """`fn(item)` for each item, in order, `in_flight` at once on threads, with at most twice that
    many submitted: memory for a window, not for a million items (Executor.map submits them all).
    Twice: while the oldest is awaited, the threads that are done go on with the next ones."""
    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="hsx-read") as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * in_flight:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


STREAM_STATE_VERSION = 1
# What a saved state must agree on with the stream it is loaded into: any of them changed would
# cut or deal other batches from the same samples, and "the batches not yet taken" would mean
# other samples.
_STATE_SETTINGS = ("job", "name", "seed", "shuffle_buffer", "token_budget", "max_batch_size", "num_replicas")


class JobStream(torch.utils.data.IterableDataset):
    """The samples of a job as they land, while it runs: a torch IterableDataset that yields what
    `HiddenStateDataset` yields, each sample of the job's plan once per epoch, as soon as it is
    stored, so training starts minutes after extraction does, not when it ends.

    `url` is the job's folder, as for HiddenStateDataset; `nats` the job's NATS server (a URL or
    `NatsSettings`; None: the HSX_NATS_* variables, as the CLI reads them). The stream learns of
    each sample from the job's `uploaded` events (hsx/wire/landed.py), never by listing, and reads
    its file with up to `max_connections` in flight, across batches. It may start before the job
    exists: it waits for the producer to record it.

    With `token_budget` it yields batches, `collate_fn` (default `pack_collate`) of their items,
    cut as `TokenBudgetSampler` cuts them (batch size x longest sample within the budget, at most
    `max_batch_size` samples); without, items one by one. Samples land in the plan's order:
    the producer's batches, longest first within each round of the plan. `shuffle_buffer` (in
    samples) mixes that order: samples wait in a pool of that many, cut into batches of like
    lengths, and leave in random batches (hsx/storage/streambatches.py); the first batch waits for
    the pool to fill once. 0 keeps the landing order.

    The first epoch ends when the job is over: done, or failed, when its missing samples are
    logged (`stream_epoch_incomplete`) and kept in `missing` (the dead-lettered samples never
    stored; `missing_count`, every planned sample that never landed). Later epochs (`set_epoch`)
    take the samples of the first, drawn at random from (`seed`, epoch) as TokenBudgetSampler
    draws them; one begun before the first has ended (a loop that left it early) waits for it.

    `num_replicas` / `rank` (data parallel, batches only): every rank reads the same events and
    cuts the same batches, and takes every `num_replicas`-th from `rank`; each sample goes to
    one rank, and every rank takes the same number of batches in an epoch (the last ones are
    split; a rank left without a sample gets `collate_fn([])`, None with the default).

    `state_dict()` is where the stream stands: its epoch and the batches (items) it has yielded in
    it. A trainer that saves it with its checkpoint and restarts from it, in another process or on
    another machine, `load_state_dict` and iterate: it gets exactly the batches of the epoch it
    had not taken, the same ones it would have had, with no file read for those skipped. Every
    rank takes the same number, so rank 0's saved state serves every rank. Iterate it in the
    training process (a DataLoader with `num_workers=0`): the state is the iterating object's.

    `name` names this trainer (its NATS connection `hsx-stream-<name>`, its state): trainers of
    other names follow the same job, each on its own, and none of them acks or holds anything of
    the job's. `on_bad_file`: as HiddenStateDataset's (a skipped item is left out of its batch)."""

    def __init__(
        self,
        url: str | Location,
        *,
        nats: str | Any = None,
        name: str = "trainer",
        concat_layers: bool = False,
        dequantize: bool = True,
        shuffle_buffer: int = 1024,
        seed: int = 0,
        token_budget: int | None = None,
        max_batch_size: int | None = None,
        collate_fn: Callable[[list[dict[str, Any]]], Any] = pack_collate,
        num_replicas: int = 1,
        rank: int = 0,
        max_connections: int = 16,
        on_bad_file: str = "raise",
    ) -> None:
        from hsx.wire.natsconn import NatsSettings
        from hsx.wire.topology import check_name

        if on_bad_file not in ON_BAD_FILE:
            raise HsxError(f"on_bad_file is {on_bad_file!r}, expected one of {', '.join(ON_BAD_FILE)}")
        check_rank(num_replicas, rank)
        if num_replicas > 1 and token_budget is None:
            raise HsxError(
                f"num_replicas {num_replicas} needs a token_budget: ranks take equal numbers of batches, "
                "and single samples cannot be split to make them equal"
            )
        LandingBatcher(token_budget=token_budget, max_batch_size=max_batch_size, shuffle_pool=shuffle_buffer)
        self.name = check_name(name, "stream name")
        self.location = Location.parse_job_folder(url, what="job folder")
        self.url, self.job = str(self.location), self.location.name
        if isinstance(nats, NatsSettings):
            self.nats = nats
        else:
            self.nats = NatsSettings.from_env(url=nats)
        self.concat_layers, self.dequantize = concat_layers, dequantize
        self.shuffle_buffer, self.seed = shuffle_buffer, seed
        self.token_budget, self.max_batch_size, self.collate_fn = token_budget, max_batch_size, collate_fn
        self.num_replicas, self.rank = num_replicas, rank
        self.max_connections, self.on_bad_file = max_connections, on_bad_file
        self.epoch = 0
        self.taken = 0  # batches (items) of this epoch yielded, or skipped on a resume
        self._resume = 0
        self.plan: str | None = None  # the job's plan and when it was produced, once read
        self.created_at: float | None = None
        self.first_epoch: EpochEnd | None = None
        self.missing: list[int] = []
        self.missing_count = 0
        self._spec: JobSpec | None = None
        # The first epoch's samples in landing order (index, tokens), once this process has read
        # them all: later epochs draw from them without replaying the markers.
        self._first_epoch_samples: tuple[np.ndarray, np.ndarray] | None = None

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads; the one a loaded state is of keeps its place."""
        if epoch != self.epoch:
            self.epoch, self.taken, self._resume = epoch, 0, 0

    def job_spec(self) -> JobSpec:
        """The job's spec (its layers, hidden size, dtype, ...), waiting for the producer to
        record it: what a trainer sizes its model from before the first batch."""
        return read_job_spec_waiting(self.nats, self.job, name=self.name)

    def state_dict(self) -> dict[str, Any]:
        end = self.first_epoch
        return {
            "version": STREAM_STATE_VERSION,
            "job": self.job,
            "name": self.name,
            "plan": self.plan,
            "created_at": self.created_at,
            "epoch": self.epoch,
            "taken": self.taken,
            "first_epoch": None if end is None else dataclasses.asdict(end),
            **{key: getattr(self, key) for key in _STATE_SETTINGS if key not in ("job", "name")},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STREAM_STATE_VERSION:
            raise HsxError(f"JobStream state version {state.get('version')!r}, this hsx reads {STREAM_STATE_VERSION}")
        for key in _STATE_SETTINGS:
            if state.get(key) != getattr(self, key):
                raise HsxError(
                    f"JobStream state has {key}={state.get(key)!r}, this stream {key}={getattr(self, key)!r}: "
                    "a state resumes only the stream that saved it (the same job, name and batching settings)"
                )
        end = state.get("first_epoch")
        self.plan, self.created_at = state.get("plan"), state.get("created_at")
        self._first_epoch_samples = None
        self.first_epoch = None if end is None else EpochEnd(**{**end, "missing": tuple(end["missing"])})
        self.epoch, self.taken, self._resume = int(state["epoch"]), int(state["taken"]), int(state["taken"])

    def _batches(self, feed: LandingFeed | None) -> Iterator[list[Landed]]:
        """Every rank's batches of this epoch, in order (each rank keeps its own by `deal`): the
        first epoch's cut as the samples land; a later one's drawn from the first's samples, as
        this process kept them, or as the feed replays them up to where the first epoch ended."""
        if feed is None:
            indices, tokens = self._first_epoch_samples
        else:
            cutter = None
            if self.epoch == 0:
                cutter = LandingBatcher(
                    token_budget=self.token_budget,
                    max_batch_size=self.max_batch_size,
                    shuffle_pool=self.shuffle_buffer,
                    seed=self.seed,
                )
            landed_indices, landed_tokens = array.array("q"), array.array("q")
            for landed in feed:
                if isinstance(landed, EpochEnd):
                    self._first_epoch_ended(landed)
                    indices = np.frombuffer(landed_indices, dtype=np.int64)
                    tokens = np.frombuffer(landed_tokens, dtype=np.int64)
                    self._first_epoch_samples = indices, tokens  # 16 bytes a sample
                    break
                landed_indices.append(landed.index)
                landed_tokens.append(landed.tokens)
                if cutter is not None:
                    yield from cutter.push(landed)
            else:
                return  # the feed was closed before the epoch's end
            if cutter is not None:
                yield from cutter.finish()
                return
        yield from shuffled_batches(
            indices,
            tokens,
            token_budget=self.token_budget,
            max_batch_size=self.max_batch_size,
            seed=self.seed,
            epoch=self.epoch,
        )

    def _first_epoch_ended(self, end: EpochEnd) -> None:
        self.first_epoch = end
        self.missing, self.missing_count = list(end.missing), end.missing_count
        if end.done:
            log.info("stream_epoch_end", job=self.job, stream=self.name, samples=end.total_samples)
            return
        log.warning(
            "stream_epoch_incomplete",
            job=self.job,
            stream=self.name,
            reason=end.reason,
            samples_missing=end.missing_count,
            dead_samples=list(end.missing[:20]),
            total_samples=end.total_samples,
        )

    def __iter__(self) -> Iterator[Any]:
        if torch.utils.data.get_worker_info() is not None:
            raise HsxError(
                "JobStream reads ahead on threads and its state is the iterating object's: give it to a "
                "DataLoader with num_workers=0"
            )
        # The batches taken before a restart are skipped unread; they stay taken.
        skip = self.taken = self._resume
        self._resume = 0
        feed = None
        if self.epoch == 0 or self._first_epoch_samples is None or self._spec is None:
            feed = LandingFeed(
                self.nats, self.job, name=self.name, plan=self.plan, created_at=self.created_at, end=self.first_epoch
            ).start()
        reads = None
        try:
            if feed is not None:
                self._spec = feed.wait_for_spec()
            assert self._spec is not None
            self.plan, self.created_at = self._spec.plan_tag, self._spec.created_at
            job_folder = Location.parse(self._spec.dest, what="the job's destination").child(self.job)
            if str(job_folder) != self.url:  # the same storage may be reached by another path here
                log.warning("stream_url_not_job_destination", url=self.url, job_destination=str(job_folder))
            expected = dataclasses.replace(ExpectedSamples.of_spec(self._spec, where=f"job {self.job}"), total=None)
            destination = open_destination(self.location, max_connections=self.max_connections)
            mine = deal(self._batches(feed), num_replicas=self.num_replicas, rank=self.rank)

            def read(landed: Landed | None) -> Any:
                if landed is None:
                    return _BATCH_END
                return self._read(destination, expected, landed)

            def entries() -> Iterator[Landed | None]:
                for batch in islice(mine, skip, None):
                    yield from batch
                    yield None  # the batch ends here

            reads = live_ordered_map(read, entries(), in_flight=self.max_connections)
            batch: list[dict[str, Any]] = []
            for entry in reads:
                if entry is not _BATCH_END:
                    if entry is not None:
                        batch.append(entry)
                    continue
                self.taken += 1
                if self.token_budget is None:
                    if batch:
                        yield batch[0]
                else:
                    yield self.collate_fn(batch)
                batch = []
        finally:
            if feed is not None:
                feed.close()  # first: the reads' source may be waiting on the feed
            if reads is not None:
                reads.close()

    def _read(self, destination: Destination, expected: ExpectedSamples, landed: Landed) -> dict[str, Any] | None:
        return _read_checked(
            destination,
            self.url,
            expected,
            landed.index,
            concat_layers=self.concat_layers,
            dequantized=self.dequantize,
            on_bad_file=self.on_bad_file,
            missing="no object at this key, although its upload was recorded",
            tokens=landed.tokens,
            sample_digest=landed.sample_digest,
        )


class _BatchEnd:
    """Where a batch ends among the items read ahead."""


_BATCH_END = _BatchEnd()


def live_ordered_map(fn: Callable[[Any], Any], items: Iterable[Any], *, in_flight: int) -> Iterator[Any]:
    """`ordered_map` for a source that waits (samples still landing): the source is iterated, and
    its items submitted, on a thread of its own, so each result is handed on as soon as it and
    those before it are done, not once the source gives `2 * in_flight` more. At most that many
    are submitted ahead. An error of the source is raised here, after the results before it."""
    submitted: queue.Queue = queue.Queue(maxsize=2 * in_flight)
    stop = threading.Event()

    def hand_over(entry: object) -> bool:
        while not stop.is_set():
            try:
                submitted.put(entry, timeout=0.2)
                return True
            except queue.Full:
                continue
        return False

    with ThreadPoolExecutor(max_workers=in_flight, thread_name_prefix="hsx-read") as pool:

        def submit_all() -> None:
            try:
                for item in items:
                    if not hand_over(pool.submit(fn, item)):
                        return
            except BaseException as exc:  # raised on the consumer's side, in order
                hand_over(_SourceFailed(exc))
                return
            hand_over(_SOURCE_DONE)

        thread = threading.Thread(target=submit_all, name="hsx-read-source", daemon=True)
        thread.start()
        try:
            while True:
                entry = submitted.get()
                if entry is _SOURCE_DONE:
                    return
                if isinstance(entry, _SourceFailed):
                    raise entry.error
                yield entry.result()
        finally:
            # The source may be waiting for its next item (the caller stops what it waits on); it
            # leaves as soon as it has one.
            stop.set()
            thread.join(timeout=1.0)


@dataclasses.dataclass(frozen=True)
class _SourceFailed:
    error: BaseException


_SOURCE_DONE = object()
