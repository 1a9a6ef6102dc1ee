"""Every GPU of a node: which devices `hsx up` runs its consumers on, and what it refuses.

`plan_devices` is given the number of visible GPUs, so 0, 1 and 4 are checked on the CPU; `hsx
up` is built from its real flags with torch's count replaced (in this process), down to the
config and environment of each consumer it would start (its GPU alone in CUDA_VISIBLE_DEVICES,
MIG slices included), without starting any. The refusals
run the real CLI as processes with CUDA_VISIBLE_DEVICES="" (no GPU visible, also on a GPU
machine). tests/test_gpu.py runs the enumeration and `hsx up --device cuda` on a real GPU.
"""

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import clean_environ
from test_cli_errors import assert_one_line_error

import hsx.gpu_consumer.model
import hsx.model.devices
from hsx.commands.cli import build_parser
from hsx.commands.up import UpConfig, consumer_configs
from hsx.config.settings import resolve
from hsx.errors import HsxError
from hsx.gpu_consumer.config import ConsumerConfig
from hsx.model.devices import (
    auto_device,
    check_consumer_device,
    child_visible_devices,
    plan_devices,
    torch_sees_cuda,
    visible_gpus,
    visible_text,
)


@pytest.mark.parametrize(
    "visible, expected",
    [
        (1, ["cuda:0"]),
        (4, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
    ],
)
def test_cuda_is_every_visible_gpu(visible, expected):
    assert plan_devices("cuda", None, visible=visible) == expected


@pytest.mark.parametrize("visible", [0, 1, 4])
def test_cpu_is_one_device_whatever_is_visible(visible):
    assert plan_devices("cpu", None, visible=visible) == ["cpu"]


def test_devices_choose_among_the_visible_gpus_in_the_order_given():
    assert plan_devices("cuda", "0,2", visible=4) == ["cuda:0", "cuda:2"]
    assert plan_devices("cuda", " 3 , 1", visible=4) == ["cuda:3", "cuda:1"]
    assert plan_devices("cuda", "0", visible=1) == ["cuda:0"]
    assert plan_devices("cuda:2", None, visible=4) == ["cuda:2"]
    assert plan_devices("cuda:0", None, visible=1) == ["cuda:0"]


@pytest.mark.parametrize(
    "device, devices, visible, needles",
    [
        ("cuda", None, 0, ("--device cuda", "no GPU visible", "--device cpu")),
        ("cuda", "0,2", 0, ("--devices 0,2", "no GPU visible")),
        ("cuda", "0,4", 4, ("--devices 0,4", "no GPU 4", "4 GPUs visible (cuda:0 to cuda:3)")),
        ("cuda", "1", 1, ("--devices 1", "no GPU 1", "1 GPU visible (cuda:0)")),
        ("cuda", "0,2,0", 4, ("--devices 0,2,0", "GPU 0 is given twice")),
        ("cuda", "0,x", 4, ("--devices '0,x'", "e.g. 0,2", "'x'")),
        ("cuda", "0,,1", 4, ("--devices '0,,1'",)),
        ("cuda", "-1", 4, ("--devices '-1'",)),
        ("cpu", "0,2", 4, ("--devices 0,2", "--device is cpu", "--device cuda --devices 0,2")),
        ("cuda:1", "0,2", 4, ("--device is cuda:1", "--device cuda:1 alone", "--device cuda --devices 0,2")),
        ("cuda:4", None, 4, ("--device cuda:4", "no GPU 4", "4 GPUs visible")),
        ("cuda:0", None, 0, ("--device cuda:0", "no GPU visible")),
        ("cuda:x", None, 4, ("--device 'cuda:x'", "cuda:N")),
    ],
)
def test_refusals_name_the_flag_and_what_is_visible(device, devices, visible, needles):
    with pytest.raises(HsxError) as raised:
        plan_devices(device, devices, visible=visible)
    message = str(raised.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, (needle, message)


def test_cuda_visible_devices_is_named_when_set():
    assert visible_text(2, "4,5") == "2 GPUs visible (cuda:0 to cuda:1) with CUDA_VISIBLE_DEVICES='4,5'"
    with pytest.raises(HsxError, match="no GPU visible with CUDA_VISIBLE_DEVICES=''"):
        plan_devices("cuda", None, visible=0, cuda_visible_devices="")


def test_consume_takes_one_device_and_cuda_is_the_first_it_sees():
    """`hsx consume`'s default, `cuda`, is `cuda:0`: the first GPU of CUDA_VISIBLE_DEVICES, which
    Slurm (--gpus-per-task) and Kubernetes' device plugin set to the GPU they allocate."""
    assert check_consumer_device("cuda:1") == "cuda:1" and check_consumer_device("cpu") == "cpu"
    assert check_consumer_device("cuda") == "cuda:0" == check_consumer_device(" cuda ")
    parser = build_parser()
    for given, environ in (([], {}), (["--device", "cuda"], {}), ([], {"HSX_DEVICE": "cuda"})):
        args = parser.parse_args(["consume", "--job", "j", *given])
        resolve(parser, args, environ)
        assert args.device == "cuda:0", (given, environ)
    # With an allocation of GPU 5 alone (Slurm's CUDA_VISIBLE_DEVICES=5), that GPU is cuda:0 for
    # the consumer, and hsx up shows its consumer of cuda:0 the same one.
    assert visible_gpus(1, "5") == ["5"] and child_visible_devices("cuda:0", visible_gpus(1, "5")) == "5"


def _up_config(
    argv: list[str], monkeypatch, visible: int, workdir: Path, *, cuda_visible_devices: str | None = None
) -> UpConfig:
    """UpConfig from `hsx up ARGV` as the CLI builds it, with `visible` GPUs as torch's count, this
    CUDA_VISIBLE_DEVICES, and no `nvidia-smi -L` to read."""
    monkeypatch.setattr(hsx.model.devices, "cuda_device_count", lambda: visible)
    monkeypatch.setattr(hsx.model.devices, "_smi_listing", lambda: None)
    # The consumer's config refuses a device torch cannot use here (commands/services.py): these
    # GPUs are stood in for, so only their names are checked.
    monkeypatch.setattr(hsx.gpu_consumer.model, "usable_device", torch.device)
    if cuda_visible_devices is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", cuda_visible_devices)
    parser = build_parser()
    args = parser.parse_args(["up", "--workdir", str(workdir), *argv])
    resolve(parser, args, {})
    return UpConfig.from_args(parser, args, nats=None, environ={})


def _devices_of(consumers: list[tuple[str, ConsumerConfig, dict]]) -> list[str]:
    """Each consumer's GPU as its process is shown it (CUDA_VISIBLE_DEVICES), or its device."""
    return [env.get("CUDA_VISIBLE_DEVICES", consumer.device) for _, consumer, env in consumers]


def test_up_starts_one_consumer_per_visible_gpu(monkeypatch, tmp_path):
    cfg = _up_config(["--device", "cuda", "--compile"], monkeypatch, visible=4, workdir=tmp_path)
    assert cfg.devices == ("cuda:0", "cuda:1", "cuda:2", "cuda:3")
    consumers = consumer_configs(cfg)
    assert [name for name, _, _ in consumers] == ["consumer-0", "consumer-1", "consumer-2", "consumer-3"]
    assert _devices_of(consumers) == ["0", "1", "2", "3"]
    for _, consumer, env in consumers:  # one spool for the node, the job's settings on each
        assert consumer.job == "demo" and consumer.compile_layers
        assert consumer.device == "cuda:0" and list(env) == ["CUDA_VISIBLE_DEVICES"]  # its GPU alone
        assert consumer.spool == tmp_path.resolve() / "spool"


def test_up_consumers_is_per_device_and_devices_chooses(monkeypatch, tmp_path):
    cfg = _up_config(["--device", "cuda", "--devices", "2,0", "--consumers", "2"], monkeypatch, 4, tmp_path)
    consumers = consumer_configs(cfg)
    assert _devices_of(consumers) == ["2", "2", "0", "0"]
    assert len({name for name, _, _ in consumers}) == 4  # each its own process, log file and instance
    cpu = consumer_configs(
        _up_config(["--device", "cpu", "--consumers", "3"], monkeypatch, visible=4, workdir=tmp_path)
    )
    assert _devices_of(cpu) == ["cpu", "cpu", "cpu"] and all(not env for _, _, env in cpu)
    one = consumer_configs(_up_config(["--device", "cuda:1"], monkeypatch, visible=4, workdir=tmp_path))
    assert _devices_of(one) == ["1"] and one[0][1].device == "cuda:0"


def test_each_consumer_is_shown_its_own_gpu_of_those_listed(monkeypatch, tmp_path):
    """CUDA_VISIBLE_DEVICES=4,6 (torch sees 2): cuda:1 is physical GPU 6, and its consumer is
    shown 6 alone; UUIDs pass through as they are."""
    cfg = _up_config(["--device", "cuda"], monkeypatch, visible=2, workdir=tmp_path, cuda_visible_devices="4,6")
    assert cfg.devices == ("cuda:0", "cuda:1") and cfg.visible_gpus == ("4", "6")
    assert _devices_of(consumer_configs(cfg)) == ["4", "6"]
    uuids = "GPU-aa11,GPU-bb22"
    cfg = _up_config(["--device", "cuda:1"], monkeypatch, visible=2, workdir=tmp_path, cuda_visible_devices=uuids)
    assert _devices_of(consumer_configs(cfg)) == ["GPU-bb22"]


def test_every_mig_slice_gets_a_consumer(monkeypatch, tmp_path):
    """Three MIG slices listed: CUDA shows a process one of them, so torch counts 1; each slice
    is still a consumer of its own, shown that slice alone."""
    slices = "MIG-11111111-aaaa,MIG-22222222-bbbb,MIG-33333333-cccc"
    cfg = _up_config(["--device", "cuda"], monkeypatch, visible=1, workdir=tmp_path, cuda_visible_devices=slices)
    assert cfg.devices == ("cuda:0", "cuda:1", "cuda:2")
    consumers = consumer_configs(cfg)
    assert _devices_of(consumers) == slices.split(",")
    assert {consumer.device for _, consumer, _ in consumers} == {"cuda:0"}
    chosen = _up_config(["--device", "cuda", "--devices", "2"], monkeypatch, 1, tmp_path, cuda_visible_devices=slices)
    assert _devices_of(consumer_configs(chosen)) == ["MIG-33333333-cccc"]
    with pytest.raises(HsxError, match="no GPU 3: 3 GPUs visible"):
        _up_config(["--device", "cuda:3"], monkeypatch, 1, tmp_path, cuda_visible_devices=slices)


SMI_MIG = """GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0a0a0a0a-1111)
  MIG 3g.40gb     Device  0: (UUID: MIG-aaaa0000-0001)
  MIG 3g.40gb     Device  1: (UUID: MIG-aaaa0000-0002)
GPU 1: NVIDIA H100 80GB HBM3 (UUID: GPU-1b1b1b1b-2222)
"""
SMI_PLAIN = """GPU 0: NVIDIA H200 (UUID: GPU-0a0a0a0a-1111)
GPU 1: NVIDIA H200 (UUID: GPU-1b1b1b1b-2222)
"""


def test_visible_gpus_from_the_variable_torchs_count_and_the_listing():
    assert visible_gpus(4, None) == ["0", "1", "2", "3"]
    assert visible_gpus(0, None) == [] and visible_gpus(0, "MIG-a") == []
    assert visible_gpus(2, "3, 1,7") == ["3", "1"]  # CUDA stops at the first it cannot use
    assert visible_gpus(1, "MIG-a,MIG-b") == ["MIG-a", "MIG-b"]
    # Nothing listed: nvidia-smi -L says whether there are slices; without any, torch's order.
    assert visible_gpus(2, None, smi_listing=SMI_PLAIN) == ["0", "1"]
    assert visible_gpus(1, None, smi_listing=SMI_MIG) == ["MIG-aaaa0000-0001", "MIG-aaaa0000-0002", "GPU-1b1b1b1b-2222"]
    assert child_visible_devices("cuda:2", ["0", "1", "MIG-c"]) == "MIG-c"
    assert child_visible_devices("cpu", ["0"]) is None


def test_up_asks_torch_only_for_a_gpu(monkeypatch, tmp_path):
    def fail():
        raise AssertionError("torch asked for a CPU run")

    monkeypatch.setattr(hsx.model.devices, "cuda_device_count", fail)
    parser = build_parser()
    args = parser.parse_args(["up", "--device", "cpu", "--consumers", "2", "--workdir", str(tmp_path)])
    resolve(parser, args, {})
    assert UpConfig.from_args(parser, args, nats=None, environ={}).devices == ("cpu",)


def test_the_cli_refuses_with_one_line(tmp_path, subtests):
    """The real `hsx`, no GPU visible; nothing is started (NATS points nowhere, no workdir made)."""
    workdir = tmp_path / "never"
    cases = {
        "consume (cuda, the default), none allocated": (
            ["consume", "--job", "j", "--spool", str(tmp_path / "s")],
            ("--device cuda:0", "CUDA is not available", "CUDA_VISIBLE_DEVICES=''"),
        ),
        "up --device cuda, none visible": (
            ["up", "--workdir", str(workdir), "--device", "cuda"],
            ("--device cuda", "no GPU visible with CUDA_VISIBLE_DEVICES=''"),
        ),
        "up --devices without cuda": (
            ["up", "--workdir", str(workdir), "--device", "cpu", "--devices", "0,2"],
            ("--devices 0,2", "--device is cpu", "--device cuda --devices 0,2"),
        ),
        "up --devices, none visible": (
            ["up", "--workdir", str(workdir), "--devices", "0,2"],
            ("--devices 0,2", "no GPU visible"),
        ),
        "up --devices twice": (
            ["up", "--workdir", str(workdir), "--device", "cuda", "--devices", "1,1"],
            ("--devices 1,1", "GPU 1 is given twice"),
        ),
    }
    env = {**clean_environ(), "CUDA_VISIBLE_DEVICES": "", "HSX_NATS_URL": "nats://127.0.0.1:1", "PYTHONUNBUFFERED": "1"}

    def run(argv):
        return subprocess.run(
            [sys.executable, "-m", "hsx.cli", *argv], env=env, capture_output=True, text=True, timeout=120
        )

    with ThreadPoolExecutor(max_workers=len(cases)) as pool:
        results = dict(zip(cases, pool.map(run, [argv for argv, _ in cases.values()])))
    for name, (_, needles) in cases.items():
        with subtests.test(case=name):
            assert results[name].returncode == 2
            assert_one_line_error(results[name], *needles)
    assert not workdir.exists() and not (tmp_path / "s").exists()


def test_up_device_auto_is_every_gpu_when_torch_sees_cuda_else_cpu():
    assert auto_device("auto", None, cuda_visible=lambda: True) == ("cuda", "auto: torch sees CUDA")
    assert auto_device("auto", None, cuda_visible=lambda: False) == ("cpu", "auto: torch sees no CUDA")
    assert auto_device("auto", "0,2", cuda_visible=lambda: False) == ("cuda", "auto: --devices chooses GPUs")

    def never() -> bool:
        raise AssertionError("torch asked for a device given")

    assert auto_device("cuda:1", None, cuda_visible=never) == ("cuda:1", None)
    assert auto_device("cpu", None, cuda_visible=never) == ("cpu", None)


def test_up_without_device_runs_on_this_machines_cpu(tmp_path):
    """This machine has no CUDA: hsx up's default (auto) is the CPU, said as chosen."""
    assert not torch_sees_cuda()
    parser = build_parser()
    args = parser.parse_args(["up", "--workdir", str(tmp_path)])
    resolve(parser, args, {})
    assert args.device == "auto"
    cfg = UpConfig.from_args(parser, args, nats=None, environ={})
    assert (cfg.device, cfg.devices, cfg.device_chosen) == ("cpu", ("cpu",), "auto: torch sees no CUDA")


def test_up_without_device_runs_on_every_gpu_torch_sees(monkeypatch, tmp_path):
    cfg = _up_config([], monkeypatch, visible=2, workdir=tmp_path)
    assert (cfg.device, cfg.devices, cfg.device_chosen) == ("cuda", ("cuda:0", "cuda:1"), "auto: torch sees CUDA")
