"""Which devices the GPU consumers of one node run on: one device per consumer process.

`--device auto` (`hsx up`'s default, `auto_device`) is `cuda` when torch sees a GPU, else `cpu`.
`--device cuda` means every GPU this process sees (torch.cuda.device_count(), which honours
CUDA_VISIBLE_DEVICES: `cuda:0` .. `cuda:N-1`), `--devices 0,2` picks some of them, `--device
cuda:N` is one GPU, and `--device cpu` (or any other torch device) is itself. `plan_devices` is
pure: it is given how many GPUs are visible and returns the device of each consumer, or a one-line
HsxError naming the flag and what is visible. `node_devices` asks torch, and only when a GPU is
asked for. `check_consumer_device` makes `hsx consume --device cuda` (its default) `cuda:0`, the
first GPU the process sees: one consumer is one process on one device, and a scheduler that
allocates a GPU (Slurm's --gpus-per-task, Kubernetes' device plugin) shows the process that one
first (CUDA_VISIBLE_DEVICES).

Each consumer process is shown only its own GPU: `visible_gpus` says which CUDA_VISIBLE_DEVICES
entry is each visible GPU, and `hsx up` starts the consumer of `cuda:i` with
CUDA_VISIBLE_DEVICES=<entry i> and `--device cuda:0` (`child_visible_devices`). Its current device
is then the model's on every thread, and a MIG slice is a GPU of its own: CUDA shows a process one
MIG instance whatever CUDA_VISIBLE_DEVICES lists, so torch counts 1 for a list of slices, which
this module counts from the list itself (or from `nvidia-smi -L` when nothing is listed).

This module knows nothing of processes (commands/up.py starts one consumer per device) or of models
(gpu_consumer/model.py loads the model on the device it is given).
"""

import os
import re
import shutil
import subprocess
from collections.abc import Callable

from hsx.errors import HsxError

_CUDA_N = re.compile(r"cuda:(\d+)")
_SMI_UUID = re.compile(r"^\s*(GPU|MIG)\b.*\(UUID: ((?:GPU|MIG)-[^)\s]+)\)", re.MULTILINE)


def visible_gpus(count: int, cuda_visible_devices: str | None, *, smi_listing: str | None = None) -> list[str]:
    """The CUDA_VISIBLE_DEVICES entry that shows a process exactly visible GPU i, for each i.

    `count` is torch's; `cuda_visible_devices` this process's variable (None: unset); `smi_listing`
    the output of `nvidia-smi -L`, read only when nothing is listed. Listed entries: the first
    `count` (CUDA stops at the first it cannot use), except MIG slices (`MIG-...`), which are
    each a GPU although torch counts one. Unset: GPU i is `i` (the same order, CUDA_DEVICE_ORDER
    being inherited), unless the listing has MIG slices: then each slice, and each GPU without
    slices, by UUID."""
    if count <= 0:
        return []
    if cuda_visible_devices is not None:
        entries = [entry.strip() for entry in cuda_visible_devices.split(",") if entry.strip()]
        if any(entry.startswith("MIG-") for entry in entries):
            return entries
        return entries[:count]
    if smi_listing:
        gpus: list[tuple[str, list[str]]] = []
        for kind, uuid in _SMI_UUID.findall(smi_listing):
            if kind == "GPU":
                gpus.append((uuid, []))
            elif gpus:
                gpus[-1][1].append(uuid)
        if any(slices for _, slices in gpus):
            return [entry for uuid, slices in gpus for entry in (slices or [uuid])]
    return [str(i) for i in range(count)]


def child_visible_devices(device: str, gpus: list[str]) -> str | None:
    """CUDA_VISIBLE_DEVICES for the consumer of `device` (`cuda:i` of `gpus`), None off CUDA."""
    match = _CUDA_N.fullmatch(device)
    return gpus[int(match.group(1))] if match else None


def visible_text(visible: int, cuda_visible_devices: str | None = None) -> str:
    """What this machine shows, for an error: "4 GPUs visible (cuda:0 to cuda:3)"."""
    if visible <= 0:
        shown = "no GPU visible"
    elif visible == 1:
        shown = "1 GPU visible (cuda:0)"
    else:
        shown = f"{visible} GPUs visible (cuda:0 to cuda:{visible - 1})"
    if cuda_visible_devices is not None:
        shown += f" with CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}"
    return shown


def _indices(devices: str) -> list[int]:
    """`--devices 0,2` as [0, 2]: GPU indices as this process sees them, each once."""
    indices: list[int] = []
    for item in devices.split(","):
        item = item.strip()
        if not item.isdigit():
            raise HsxError(f"--devices {devices!r}: expected GPU indices separated by commas, e.g. 0,2 (got {item!r})")
        if int(item) in indices:
            raise HsxError(f"--devices {devices}: GPU {int(item)} is given twice")
        indices.append(int(item))
    return indices


def plan_devices(
    device: str, devices: str | None, *, visible: int, cuda_visible_devices: str | None = None
) -> list[str]:
    """The torch device of each consumer of this node, from `--device` and `--devices` and the
    number of GPUs visible (`cuda_visible_devices` only words the errors)."""
    device = device.strip()
    seen = visible_text(visible, cuda_visible_devices)
    if devices is not None:
        if device != "cuda":
            also = f"--device {device} alone, or " if _CUDA_N.fullmatch(device) else ""
            raise HsxError(
                f"--devices {devices} chooses GPUs but --device is {device}: give {also}"
                f"--device cuda --devices {devices}"
            )
        indices = _indices(devices)
        if visible <= 0:
            raise HsxError(f"--devices {devices}: {seen}")
        missing = [i for i in indices if i >= visible]
        if missing:
            raise HsxError(f"--devices {devices}: there is no GPU {missing[0]}: {seen}")
        return [f"cuda:{i}" for i in indices]
    if device == "cuda":
        if visible <= 0:
            raise HsxError(f"--device cuda: {seen} (torch.cuda.device_count() is 0); use --device cpu")
        return [f"cuda:{i}" for i in range(visible)]
    if device.startswith("cuda"):
        match = _CUDA_N.fullmatch(device)
        if not match:
            raise HsxError(f"--device {device!r} is not a device (use cpu, cuda for every GPU, or cuda:N)")
        if int(match.group(1)) >= visible:
            raise HsxError(f"--device {device}: there is no GPU {int(match.group(1))}: {seen}")
        return [f"cuda:{int(match.group(1))}"]
    return [device]


def cuda_device_count() -> int:
    """GPUs this process sees (CUDA_VISIBLE_DEVICES honoured); 0 without CUDA."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _smi_listing() -> str | None:
    """`nvidia-smi -L`, or None where it is not there or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        return subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def auto_device(device: str, devices: str | None, *, cuda_visible: Callable[[], bool]) -> tuple[str, str | None]:
    """`hsx up --device auto` (its default) and why: `cuda`, every visible GPU, when `--devices`
    chooses GPUs or `cuda_visible()` (torch sees CUDA), else `cpu`. Any other device is itself,
    unasked, with no why."""
    if device.strip() != "auto":
        return device, None
    if devices is not None:
        return "cuda", "auto: --devices chooses GPUs"
    if cuda_visible():
        return "cuda", "auto: torch sees CUDA"
    return "cpu", "auto: torch sees no CUDA"


def torch_sees_cuda() -> bool:
    """Whether torch sees a GPU here (CUDA_VISIBLE_DEVICES honoured); False without torch."""
    try:
        return cuda_device_count() > 0
    except ImportError:
        return False


def node_gpus(device: str) -> list[str]:
    """`visible_gpus` of this node; [] (nothing asked) unless `device` is a GPU."""
    if not device.strip().startswith("cuda"):
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = cuda_device_count()
    return visible_gpus(count, listed, smi_listing=_smi_listing() if listed is None and count > 0 else None)


def node_devices(device: str, devices: str | None, *, gpus: list[str] | None = None) -> list[str]:
    """`plan_devices` with this node's GPUs (`node_gpus`, or those given); torch is imported only
    when a GPU is asked for."""
    visible = len(node_gpus(device) if gpus is None else gpus)
    return plan_devices(device, devices, visible=visible, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))


def check_consumer_device(device: str) -> str:
    """`hsx consume`'s one device: `cuda` is `cuda:0`, the first GPU this process sees (a consumer
    runs on one GPU: `hsx up --device cuda` starts one on every GPU)."""
    return "cuda:0" if device.strip() == "cuda" else device
