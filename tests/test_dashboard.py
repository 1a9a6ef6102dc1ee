"""The shipped Grafana dashboard (deploy/grafana/hsx.json) against a real Prometheus (Debian's
`prometheus`, installed with apt-get when missing) scraping a running `hsx monitor
--metrics-port` with the shipped scrape config (deploy/prometheus/prometheus.yml, its target
pointed at the monitor): every query of every panel, and the job variable's, is evaluated through
Prometheus' HTTP API and returns data for the job. A query that names a metric the monitor does
not expose fails, and so would a scrape config without `honor_labels: true` (Prometheus would
move hsx's `job` label to `exported_job`, and the dashboard's `job="$job"` would match nothing).
promtool checks the shipped config and alert rules.

Real nats-server, tiny real model on the CPU, every service a subprocess.
"""

import json
import re
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
import yaml
from browser import ensure_installed
from conftest import REPO, _free_port
from test_e2e_s3 import logs_of, produce, write_dataset

DASHBOARD = REPO / "deploy" / "grafana" / "hsx.json"
SCRAPE_CONFIG = REPO / "deploy" / "prometheus" / "prometheus.yml"
ALERTS = REPO / "deploy" / "prometheus" / "alerts.yml"
SCRAPE_S = 1
# Grafana's $__rate_interval is at least four scrape intervals.
RATE_INTERVAL = f"{4 * SCRAPE_S}s"


def dashboard_queries() -> dict[str, str]:
    """'panel title / refId' -> expr, for every target of every panel, and the job variable's."""
    dashboard = json.loads(DASHBOARD.read_text())
    queries = {
        f"{panel['title']} / {target['refId']}": target["expr"]
        for panel in dashboard["panels"]
        for target in panel.get("targets", [])
    }
    for variable in dashboard["templating"]["list"]:
        if variable["type"] == "query":
            queries[f"variable {variable['name']}"] = variable["query"]["query"]
    return queries


def prom_get(base: str, path: str, **params) -> dict:
    url = f"{base}{path}?{urllib.parse.urlencode(params, doseq=True)}"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def evaluate(base: str, expr: str, job: str) -> list:
    """What the panel shows for `job`: Grafana's variables substituted, evaluated now. A
    `label_values(METRIC, LABEL)` variable query is the label's values on the metric's series."""
    expr = expr.replace("$__rate_interval", RATE_INTERVAL).replace("$job", job)
    values = re.fullmatch(r"label_values\((\w+),\s*(\w+)\)", expr)
    if values:
        metric, label = values.groups()
        return prom_get(base, f"/api/v1/label/{label}/values", **{"match[]": metric})
    return prom_get(base, "/api/v1/query", query=expr)["result"]


@pytest.mark.timeout(600)  # the first run on a machine installs prometheus (apt-get), maybe after chromium
def test_every_dashboard_query_returns_the_jobs_data_through_prometheus(
    tmp_path, hsx, hsx_service, tiny_model, job_name
):
    prometheus = ensure_installed("prometheus", "prometheus")
    promtool = shutil.which("promtool")
    checked = subprocess.run([promtool, "check", "config", str(SCRAPE_CONFIG)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stdout + checked.stderr  # the alert rules are checked with it

    job = job_name
    write_dataset(tmp_path / "data.jsonl", 16, min_len=4, max_len=60, seed=8)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=128,
        max_seq_len=64,
        env=None,
    )
    metrics_port, prom_port = _free_port(), _free_port()
    monitor = hsx_service(
        "monitor", "--job", job, "--interval", "0.5", "--metrics-port", str(metrics_port), name="monitor"
    )
    spool = str(tmp_path / "spool")
    procs = [
        monitor,
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, name="consume"),
        hsx_service("upload", "--job", job, "--spool", spool, name="upload"),
    ]

    # The shipped config, as shipped but for where the monitor is and how often it is scraped.
    config = yaml.safe_load(SCRAPE_CONFIG.read_text())
    [scrape] = [s for s in config["scrape_configs"] if s["job_name"] == "hsx-monitor"]
    assert scrape["honor_labels"] is True, scrape
    scrape["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    config["global"]["scrape_interval"] = f"{SCRAPE_S}s"
    config["rule_files"] = [str(ALERTS)]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    with open(tmp_path / "prometheus.log", "wb") as log:
        server = subprocess.Popen(
            [
                prometheus,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prom_port}",
            ],
            stdout=log,
            stderr=log,
        )
    base = f"http://127.0.0.1:{prom_port}"
    try:
        deadline = time.monotonic() + 120
        # Until the job is done and Prometheus holds enough scrapes of it for a rate.
        while True:
            assert server.poll() is None, Path(tmp_path / "prometheus.log").read_text()[-3000:]
            assert all(p.poll() is None for p in procs), logs_of(*procs)
            try:
                done = evaluate(base, f'count_over_time(hsx_job_done{{job="{job}"}}[1m])', job)
                finished = evaluate(base, f'hsx_job_done{{job="{job}"}} == 1', job)
            except OSError:  # Prometheus is not listening yet
                done = finished = []
            if finished and done and float(done[0]["value"][1]) >= 4:
                break
            assert time.monotonic() < deadline, f"job not done in Prometheus within 120 s\n{logs_of(*procs)}"
            time.sleep(0.5)

        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as response:
            exposition = response.read().decode()
        exposed = {line.split("{")[0].split(" ")[0] for line in exposition.splitlines() if line.startswith("hsx_")}
        failures = []
        for name, expr in dashboard_queries().items():
            unknown = {metric for metric in re.findall(r"\bhsx_\w+", expr) if metric not in exposed}
            if unknown:
                failures.append(f"{name}: names metrics the monitor does not expose: {sorted(unknown)}")
                continue
            result = evaluate(base, expr, job)
            if not result:
                failures.append(f"{name}: no data for job {job}: {expr}")
            elif name.startswith("variable"):
                if job not in result:
                    failures.append(f"{name}: {result} lacks job {job}")
            elif any(series["metric"].get("job", job) != job for series in result):
                failures.append(f"{name}: series of another job: {result}")
        assert not failures, "\n".join(failures)
        # The job's label is hsx's own, kept by honor_labels: no series was renamed.
        assert not evaluate(base, "{exported_job!=''}", job)
        assert float(evaluate(base, f'hsx_samples_uploaded_total{{job="{job}"}}', job)[0]["value"][1]) == 16
    finally:
        server.terminate()
        server.wait(timeout=30)
