"""`hsx produce --dry-run`'s measurement of how a compressed job's states compress
(hsx/producer/measure.py says what is measured): the trunk the job's layers run is loaded and
the samples `pick_samples` draws are run through it with the consumer's own code
(gpu_consumer/model.py `load_model`, gpu_consumer/extract.py `extract_samples`: no second
forward), and each sample's states encoded with the job's encoding as the writer encodes them.
It is a command's because it joins two services, the producer's samples and the consumer's
forward; `hsx produce` hands `measure_states` to the producer.

Where it cannot measure it raises `NotMeasured`, one line saying why: torch is not installed (a
producer-only install), `--estimate-device` is no device torch can use here, the trunk's
weights are more than MEMORY_FRACTION of the memory free where they would load, the model does
not load, its forward fails. torch is imported only when it runs.
"""

import importlib.util
import os
from pathlib import Path

import msgspec

from hsx.errors import HsxError
from hsx.producer.measure import SAMPLE_TOKENS, Measured, NotMeasured, pick_samples
from hsx.storage.encodings.compressed import COMPRESSED, CompressedEncoding
from hsx.storage.fsutil import human_bytes
from hsx.storage.layout import SampleFiles
from hsx.storage.tokens import SampleTable
from hsx.wire import schemas

# The trunk's weights must fit in this share of the memory free where they load (the host's for
# cpu, counting a cgroup's limit; the GPU's for cuda): a dry run must not push its host into swap.
MEMORY_FRACTION = 0.5


def _batches(samples: list[schemas.Sample], token_budget: int) -> list[list[schemas.Sample]]:
    """The samples by length in batches of at most `token_budget` padded tokens."""
    batches: list[list[schemas.Sample]] = []
    for sample in sorted(samples, key=lambda s: len(s.input_ids)):
        if batches and (len(batches[-1]) + 1) * len(sample.input_ids) <= token_budget:
            batches[-1].append(sample)
        else:
            batches.append([sample])
    return batches


def available_memory(device) -> int | None:
    """Bytes free for new allocations on a torch device: the host's available memory (within a
    cgroup v2 memory limit, where one is set) for cpu, the GPU's free memory for cuda; None where
    it cannot be asked."""
    if device.type == "cuda":
        import torch

        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except OSError:
        try:
            free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            free = max(0, int(limit) - used) if free is None else min(free, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return free


def measure_states(files: SampleFiles, rows: SampleTable, device: str) -> Measured:
    """The compressed over uncompressed bytes of the states of `pick_samples` of the job's
    samples, computed on `device` as a consumer computes them; NotMeasured saying why not."""
    spec, encoding = files.spec, files.encoding
    if not isinstance(encoding, CompressedEncoding):
        raise ValueError(f"{spec.dtype} is not a compressed encoding: its size is exact")
    if len(rows) == 0:
        raise NotMeasured("the job has no samples to measure")
    if importlib.util.find_spec("torch") is None:
        raise NotMeasured("torch is not installed here (a producer-only install; hsx-extract[gpu] has it)")
    import torch

    from hsx.gpu_consumer.extract import extract_samples
    from hsx.gpu_consumer.model import load_model, usable_device
    from hsx.gpu_consumer.trunk import trunk_weight_bytes

    revision = None if spec.model_revision == "local" else spec.model_revision
    model = {"layers": list(spec.layers), "trust_remote_code": spec.trust_remote_code, "revision": revision}
    try:
        target = usable_device(device)
        weights = trunk_weight_bytes(spec.model, dtype=getattr(torch, encoding.compute), **model)
        free = available_memory(target)
        if free is not None and weights > MEMORY_FRACTION * free:
            raise NotMeasured(
                f"the model's trunk for these layers is {human_bytes(weights)} of weights, more than "
                f"{MEMORY_FRACTION:.0%} of the {human_bytes(free)} free on {target} (--estimate-device)"
            )
        loaded = load_model(spec.model, encoding=encoding, device=device, **model)
    except HsxError as exc:
        raise NotMeasured(str(exc).replace("--device", "--estimate-device")) from None
    picked = pick_samples(rows.lengths)
    samples = [rows.sample(int(i)) for i in picked.tolist()]
    samples = [msgspec.structs.replace(s, input_ids=s.input_ids[:SAMPLE_TOKENS]) for s in samples]
    raw = packed = 0
    try:
        for batch in _batches(samples, spec.token_budget):
            states = extract_samples(loaded, batch)
            for sample, sample_states in zip(batch, states):
                packed += encoding.encode(sample_states)[COMPRESSED].numel()
                raw += encoding.states_bytes(len(sample.input_ids), len(spec.layers), spec.hidden_size)
    except Exception as exc:  # out of memory, non-finite states, a model the forward fails on
        line = (str(exc).strip().splitlines() or [""])[0][:200]
        raise NotMeasured(f"the forward on {device} failed ({type(exc).__name__}: {line})") from None
    finally:
        del loaded
    tokens = sum(len(sample.input_ids) for sample in samples)
    return Measured(samples=len(samples), tokens=tokens, ratio=round(packed / raw, 6), device=device)
