"""Which devices the GPU consumers of one node run on: one device per consumer process.

`--device cuda` means every GPU this process sees (torch.cuda.device_count(), which honours
CUDA_VISIBLE_DEVICES: `cuda:0` .. `cuda:N-1`), `--devices 0,2` picks some of them, `--device
cuda:N` is one GPU, and `--device cpu` (or any other torch device) is itself. `plan_devices` is
pure: it is given how many GPUs are visible and returns the device of each consumer, or a one-line
HsxError naming the flag and what is visible. `node_devices` asks torch, and only when a GPU is
asked for. `check_consumer_device` refuses `hsx consume --device cuda`: one consumer is one
process on one device.

This module knows nothing of processes (commands/up.py starts one consumer per device) or of models
(gpu_consumer/model.py loads the model on the device it is given).
"""

import os
import re

from hsx.errors import HsxError

_CUDA_N = re.compile(r"cuda:(\d+)")


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


def node_devices(device: str, devices: str | None) -> list[str]:
    """`plan_devices` with the GPUs torch sees; torch is imported only when a GPU is asked for."""
    visible = cuda_device_count() if device.strip().startswith("cuda") else 0
    return plan_devices(device, devices, visible=visible, cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"))


def check_consumer_device(device: str) -> str:
    """`hsx consume`'s one device: `cuda` alone is refused with where to go instead."""
    if device.strip() == "cuda":
        raise HsxError(
            "--device cuda: hsx consume runs on one GPU; use --device cuda:0 (one consumer per GPU: "
            "cuda:0, cuda:1, ...), or hsx up --device cuda for a consumer on every GPU of this node"
        )
    return device
