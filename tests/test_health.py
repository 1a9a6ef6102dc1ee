"""A worker's probes (hsx/wire/health.py, `--health-port`): /readyz 200 once it takes work, 503
before and once stopping; /livez 200 while starting and while its loop turns within its bound
with nothing stalled, 503 otherwise. The server and its answers in this process; then a real
consumer and uploader probed over HTTP from their start to their stop."""

import json
import signal
import socket
import time
import urllib.error
import urllib.request

import pytest
from conftest import _free_port
from test_e2e_s3 import logs_of, produce, write_dataset

from hsx.errors import HsxError
from hsx.exitcodes import BAD_INPUT, STOPPED
from hsx.wire.health import Health, HealthServer, http_url, listen_address, parse_listen


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


class _Stop:
    """An event's flag, as the server reads it."""

    def __init__(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag


def test_the_probes_answer_what_the_worker_says():
    bound = {"s": 60.0}
    stalled: dict = {"what": None}
    health = Health(turn_bound_s=lambda: bound["s"], stalled=lambda: stalled["what"])
    server = HealthServer(health, addr="127.0.0.1", port=0)
    try:
        ready, live = f"{server.url}/readyz", f"{server.url}/livez"
        assert _get(ready) == (503, {"ready": False, "state": "starting"})
        assert _get(live) == (200, {"live": True, "state": "starting"})  # a model load is not a hang
        health.ready()
        health.tick()
        assert _get(ready) == (200, {"ready": True, "state": "ready"})
        code, body = _get(live)
        assert code == 200 and body["state"] == "running" and body["bound_s"] == 60.0, body
        bound["s"] = -1.0  # the last turn is older than the bound: the loop is not turning
        code, body = _get(live)
        assert code == 503 and body["state"] == "loop not turning", body
        bound["s"] = 60.0
        stalled["what"] = "forward of batch b-1 running 301 s, past its 300 s bound"
        code, body = _get(live)
        assert code == 503 and body["state"] == "stalled" and body["stalled"].startswith("forward"), body
        stalled["what"] = None
        stop = _Stop()
        health.watch_stop(stop)
        stop.flag = True
        assert _get(ready) == (503, {"ready": False, "state": "stopping"})  # draining: send it nothing
        assert _get(live)[0] == 200
        assert _get(f"{server.url}/metrics")[0] == 404
    finally:
        server.close()


def test_health_port_values():
    parse = parse_listen("--health-port")
    assert listen_address(parse("9200"), "127.0.0.1") == ("127.0.0.1", 9200)
    assert listen_address(parse(" 0.0.0.0:9200 "), "127.0.0.1") == ("0.0.0.0", 9200)
    # An IPv6 address in brackets, as in a URL (a pod's address on an IPv6 cluster).
    assert listen_address(parse("[::]:9200"), "127.0.0.1") == ("::", 9200)
    assert listen_address(parse("[fd00::1]:9200"), "127.0.0.1") == ("fd00::1", 9200)
    assert http_url("::1", 9200) == "http://[::1]:9200/" and http_url("10.0.0.1", 80) == "http://10.0.0.1:80/"
    for bad in ("0", "65536", "http", ":9200", "host:", "[]:9200"):
        with pytest.raises(HsxError, match="--health-port"):
            parse(bad)
    for bad in ("::1:9200", "fd00::1:9200", "[::1:9200", "::1]:9200", "[host]:9200"):
        with pytest.raises(HsxError, match="brackets|not an IPv6 address"):
            parse(bad)


def test_the_probes_answer_on_an_ipv6_address():
    try:
        socket.socket(socket.AF_INET6).close()
    except OSError:
        pytest.skip("no IPv6 on this machine")
    health = Health(turn_bound_s=lambda: 10.0)
    server = HealthServer(health, addr="::1", port=0)
    try:
        assert server.url.startswith("http://[::1]:")
        assert _get(f"{server.url}/livez")[0] == 200
    finally:
        server.close()


def _wait_for(what, predicate, procs, timeout: float = 120):
    deadline = time.monotonic() + timeout
    while not (result := predicate()):
        for proc in procs:
            assert proc.poll() is None, logs_of(*procs)
        assert time.monotonic() < deadline, f"{what}: not within {timeout:.0f} s\n{logs_of(*procs)}"
        time.sleep(0.2)
    return result


def test_a_consumer_and_an_uploader_are_ready_once_they_take_work(hsx, hsx_service, tiny_model, job_name, tmp_path):
    spool = str(tmp_path / "spool")
    consumer_port, uploader_port = _free_port(), _free_port()
    consumer = hsx_service(
        "consume", "--job", job_name, "--device", "cpu", "--spool", spool, env={"HSX_HEALTH_PORT": str(consumer_port)},
        name="consume",
    )  # fmt: skip
    uploader = hsx_service("upload", "--job", job_name, "--spool", spool, "--health-port", str(uploader_port))
    procs = [consumer, uploader]
    urls = {name: f"http://127.0.0.1:{port}" for name, port in (("consume", consumer_port), ("upload", uploader_port))}

    def answers(name: str, path: str):
        try:
            return _get(urls[name] + path)
        except (urllib.error.URLError, ConnectionError):
            return None  # not listening yet

    # Waiting for their job: alive, not ready.
    for name in urls:
        assert _wait_for(f"{name} listening", lambda n=name: answers(n, "/livez"), procs) == (
            200,
            {"live": True, "state": "starting"},
        )
        assert answers(name, "/readyz") == (503, {"ready": False, "state": "starting"})

    write_dataset(tmp_path / "data.jsonl", 8, min_len=4, max_len=20, seed=4)
    produce(
        hsx,
        job=job_name,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=64,
        max_seq_len=32,
        env=None,
    )
    for name in urls:
        _wait_for(f"{name} ready", lambda n=name: (answers(n, "/readyz") or (0,))[0] == 200, procs)
        code, body = answers(name, "/livez")
        assert code == 200 and body["state"] == "running" and body["last_turn_s"] <= body["bound_s"], body
    print(f"\nHEALTH live: consumer {answers('consume', '/livez')[1]}, uploader {answers('upload', '/livez')[1]}")

    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        assert proc.wait(timeout=60) == STOPPED, logs_of(*procs)


def test_a_health_port_that_cannot_be_listened_on_is_bad_input(hsx_service, job_name, tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        uploader = hsx_service("upload", "--job", job_name, "--spool", str(tmp_path / "s"), "--health-port", str(port))
        assert uploader.wait(timeout=60) == BAD_INPUT, logs_of(uploader)
    text = uploader.log_path.read_text()
    assert f"hsx: error: --health-port: cannot listen on 127.0.0.1:{port}" in text and "Traceback" not in text, text
