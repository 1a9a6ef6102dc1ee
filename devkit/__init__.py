"""Fixtures for tests and benchmarks, not part of the product (not installed with hsx): a
three-node JetStream cluster on loopback (the configuration docs/operations/multi-node.md describes, with
local ports). SmolLM2-135M-Instruct is the product's: commands/smollm2.py (`hsx demo model --chat`).
"""

import json
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
