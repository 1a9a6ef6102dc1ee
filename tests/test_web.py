"""`hsx monitor --http`: the job's page in a real browser (Debian's chromium, headless, driven by
Playwright) while a real job runs: opened before the job exists (as compose starts the monitor
first), it shows the job once it is produced; the numbers it shows equal `hsx status --json` read
at the same moment (within one update of the page), it updates without a reload as samples land, `/api/status`
is what `hsx status --json` prints, and a screenshot of it at the job's end is written
(`page-done.png` in the test's folder). A stalled job (its only worker killed) and a failed job
(its poison sample dead-lettered) each show their state and why, the failed one reached from the
page's list of the jobs NATS holds.

Real nats-server, tiny real model on the CPU, every service a subprocess.
"""

import json
import signal
import time
import urllib.error
import urllib.request

import pytest
from browser import READ_FIELDS, Browser, ensure_installed
from conftest import _free_port
from test_e2e_s3 import logs_of, produce, status, write_dataset

NODE = "testnode"
# Counts that only grow, as the page shows them and `hsx status --json` names them.
GROWING = {
    "progress.samples_written": "samples_written",
    "progress.samples_uploaded": "samples_uploaded",
    "progress.tokens_written": "tokens_written",
    "progress.tokens_uploaded": "tokens_uploaded",
    "progress.bytes_written": "bytes_written",
    "progress.bytes_uploaded": "bytes_uploaded",
    "progress.batches_done": "batches_done",
}
FIXED = {
    "progress.samples_total": "total_samples",
    "progress.tokens_total": "total_tokens",
    "progress.batches_total": "batches_total",
    "dead.letters": "dead_letters",
    "state": "state",
}
# What /api/status and a later `hsx status --json` may differ in: the time of the reading and the
# rate, which each takes over its own window.
OWN_WINDOW = {"as_of", "samples_per_s"}


@pytest.fixture(scope="module")
def browser():
    ensure_installed("chromium", "chromium")
    chromium = Browser()
    yield chromium
    chromium.close()


def get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait_for(condition, *, timeout: float, what: str, procs=(), period: float = 0.25):
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout:.0f} s\n{logs_of(*procs)}")
        time.sleep(period)


def shown(browser: Browser) -> dict:
    """The page's numbers now, with the time of the reading they come from."""
    fields = browser.evaluate(READ_FIELDS)
    fields["as_of"] = float(fields["as_of"])
    return fields


def number(value: str) -> int:
    return int(float(value))


def open_page(browser: Browser, url: str, *, procs) -> None:
    browser.call(lambda page: page.goto(url))
    wait_for(lambda: shown(browser)["as_of"] > 0, timeout=30, what=f"a first reading on {url}", procs=procs)


def next_reading_after(browser: Browser, moment: float, *, procs) -> dict:
    """The page's numbers once it shows a reading taken after `moment` (time.time())."""
    return wait_for(
        lambda: (fields := shown(browser))["as_of"] > moment and fields,
        timeout=30,
        what="the page's next reading",
        procs=procs,
    )


def spawn_monitor(hsx_service, job: str, port: int, *, interval: str = "0.5"):
    return hsx_service(
        *("monitor", "--job", job, "--interval", interval, "--silent-after", "7", "--http", str(port)),
        name=f"monitor-{job}",
    )


@pytest.mark.timeout(600)  # the first run on a machine installs chromium (apt-get)
def test_the_page_follows_a_running_job_and_agrees_with_status(
    tmp_path, hsx, hsx_service, browser, tiny_model, job_name
):
    job = job_name
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    # The monitor and its page come first, as in compose: the job is not produced yet.
    monitor = spawn_monitor(hsx_service, job, port)
    procs = [monitor]
    wait_for(lambda: _answers(f"{base}/static/app.js"), timeout=30, what="the page's server", procs=procs)
    browser.call(lambda page: page.goto(f"{base}/"))
    # A mark the page keeps until it is loaded again: it must survive every update.
    browser.evaluate("() => { window.loadedOnce = 'yes'; }")
    write_dataset(tmp_path / "data.jsonl", 24, min_len=4, max_len=120, seed=5)
    produce(
        hsx,
        job=job,
        model=tiny_model("qwen3"),
        dataset=tmp_path / "data.jsonl",
        dest=str(tmp_path / "out"),
        token_budget=256,
        max_seq_len=128,
        env=None,
    )
    wait_for(lambda: shown(browser)["as_of"] > 0, timeout=30, what="the page's first reading", procs=procs)

    # Before any worker: the plan, nothing done, and no worker alive.
    before = shown(browser)
    planned = status(hsx, job, None)
    for field, key in {**GROWING, **FIXED}.items():
        expected = planned[key]
        assert (before[field] if key == "state" else number(before[field])) == expected, (field, before, planned)
    assert before["state"] == "waiting for workers", before

    spool = str(tmp_path / "spool")
    procs += [
        hsx_service("consume", "--job", job, "--device", "cpu", "--spool", spool, name="consume"),
        hsx_service("upload", "--job", job, "--spool", spool, name="upload"),
    ]
    # While it runs: each `hsx status` lies between the page's reading before it and the one
    # after it (the counts only grow), and the page moves by itself.
    seen_uploaded, compared = set(), 0
    while True:
        earlier = shown(browser)
        now = status(hsx, job, None)
        after = next_reading_after(browser, time.time(), procs=procs)
        for field, key in GROWING.items():
            assert number(earlier[field]) <= now[key] <= number(after[field]), (field, earlier, now, after)
        assert (
            number(after["progress.batches_queued"])
            <= now["batches_queued"]
            <= number(earlier["progress.batches_queued"])
        ), (earlier, now, after)
        compared += 1
        seen_uploaded.add(number(after["progress.samples_uploaded"]))
        if after["state"] == "done":
            break
        assert all(p.poll() is None for p in procs), logs_of(*procs)
    assert compared >= 2 and len(seen_uploaded) >= 2, (compared, seen_uploaded)
    assert browser.evaluate("() => window.loadedOnce") == "yes"  # never reloaded

    # Done: every number equals `hsx status --json`; /api/status is what it prints.
    final = status(hsx, job, None)
    assert final["done"] and final["samples_uploaded"] == 24, final
    page = next_reading_after(browser, time.time(), procs=procs)
    for field, key in {**GROWING, **FIXED}.items():
        assert (page[field] if key == "state" else number(page[field])) == final[key], (field, page, final)
    assert page["eta_s"] == "0" and number(page["progress.percent"]) == 100, page
    # /api/status read just before and just after `hsx status`: each field it prints is what the
    # page said at one of the two (a heartbeat may land in between: a consumer's kernels, its state).
    api_before = get_json(f"{base}/api/status")
    printed = status(hsx, job, None)
    read_at = time.time()
    api_after = wait_for(
        lambda: (api := get_json(f"{base}/api/status"))["as_of"] > read_at and api,
        timeout=30,
        what="the page's next reading",
        procs=procs,
    )
    assert set(api_before) == set(printed) == set(api_after), sorted(set(api_before) ^ set(printed))
    differ = {key for key in printed if printed[key] not in (api_before[key], api_after[key])}
    assert differ <= OWN_WINDOW, {key: (api_before[key], printed[key], api_after[key]) for key in differ}

    # The workers' rows: a consumer on the CPU and an uploader, from node testnode, alive.
    # The consumer beats once its model is loaded: shown past "starting", however short the job.
    def rows_past_starting():
        rows = browser.evaluate(
            "() => [...document.querySelectorAll('#workers tbody tr')]"
            ".map(r => [r.dataset.state, r.cells[1].textContent, r.cells[2].textContent])"
        )
        return rows if rows and all(state != "starting" for state, _, _ in rows) else None

    rows = wait_for(rows_past_starting, timeout=30, what="the workers past starting on the page", procs=procs)
    assert sorted(device for _, _, device in rows) == ["cpu", "uploader"], rows
    assert all(node == NODE and state != "silent" for state, node, _ in rows), rows
    # The node's spool, drained: the uploader measures it as its last upload ends, and a node
    # shows its newest measurement (within a reading or two of the end; the bound is NATS's).
    wait_for(
        lambda: (
            browser.evaluate(f"() => document.querySelector('#nodes tr[data-node=\"{NODE}\"]')?.cells[1].textContent")
            == "0"
        ),
        timeout=30,
        what="the drained spool on the page",
        procs=procs,
    )
    screenshot = tmp_path / "page-done.png"
    browser.call(lambda page: page.screenshot(path=str(screenshot), full_page=True))
    assert screenshot.stat().st_size > 10_000
    print(f"screenshot of the page at the job's end: {screenshot}")

    # Read-only: nothing but GET and HEAD.
    request = urllib.request.Request(f"{base}/api/status", method="POST", data=b"{}")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 405
    monitor.send_signal(signal.SIGTERM)
    assert monitor.wait(timeout=30) in (0, 75), logs_of(monitor)


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.status == 200
    except OSError:
        return False


@pytest.mark.faults
@pytest.mark.timeout(600)  # the first run on a machine installs chromium (apt-get)
def test_a_stalled_job_and_a_failed_one_each_say_so_and_why(tmp_path, hsx, hsx_service, browser, tiny_model):
    stalled, failed = f"stall{time.time_ns() % 10**8}", f"fail{time.time_ns() % 10**8}"
    for job, seed in ((stalled, 3), (failed, 4)):
        write_dataset(tmp_path / f"{job}.jsonl", 6, min_len=4, max_len=20, seed=seed)
        produce(
            hsx,
            job=job,
            model=tiny_model("qwen3"),
            dataset=tmp_path / f"{job}.jsonl",
            dest=str(tmp_path / "out"),
            token_budget=64,
            max_seq_len=32,
            env=None,
        )
    # Stalled: its only consumer pauses at a 1-byte high-water mark after its first batches (no
    # uploader runs), and is killed: work left, something done, no worker alive.
    consumer = hsx_service(
        *("consume", "--job", stalled, "--device", "cpu", "--spool", str(tmp_path / "spool-a")),
        *("--spool-high-water", "1"),
        name="consume-stalled",
    )
    # Failed: sample 3's forward fails on every delivery; it is dead-lettered, the rest uploaded.
    spool = str(tmp_path / "spool-b")
    poisoned = [
        hsx_service(
            *("consume", "--job", failed, "--device", "cpu", "--spool", spool, "--retry-delay", "0.1"),
            env={"HSX_TEST_FAIL_SAMPLE": "3"},
            name="consume-failed",
        ),
        hsx_service("upload", "--job", failed, "--spool", spool, name="upload-failed"),
    ]
    procs = [consumer, *poisoned]
    wait_for(lambda: status(hsx, stalled, None)["samples_written"] > 0, timeout=90, what="a batch written", procs=procs)
    consumer.send_signal(signal.SIGKILL)
    consumer.wait(timeout=10)

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    monitor = spawn_monitor(hsx_service, stalled, port)
    procs.append(monitor)
    wait_for(lambda: _answers(f"{base}/api/page"), timeout=30, what="the page's first reading", procs=procs)
    open_page(browser, f"{base}/", procs=procs)
    # The killed consumer's last beat is at most one heartbeat interval (5 s) old when it dies;
    # the monitor calls it silent --silent-after (7 s) later.
    page = wait_for(
        lambda: (fields := shown(browser))["state"] == "stalled" and fields,
        timeout=30,
        what="the stalled job shown stalled",
        procs=procs,
    )
    assert "no worker alive" in page["reason"], page
    rows = browser.evaluate("() => [...document.querySelectorAll('#workers tbody tr')].map(r => r.dataset.state)")
    # (`hsx status` says so too, once its own window, 30 s, has passed: the page follows the
    # monitor's --silent-after.)
    assert rows == ["silent"], rows

    # The failed job, one click away: the list of the jobs NATS holds.
    wait_for(lambda: status(hsx, failed, None)["failed"], timeout=120, what="the poisoned job failed", procs=procs)
    options = browser.evaluate("() => [...document.querySelectorAll('#jobs option')].map(o => o.value)")
    assert {stalled, failed} <= set(options), options
    browser.call(lambda page: page.select_option("#jobs", failed))
    wait_for(
        # location.href, not page.url: Playwright's sync API updates page.url only while a call runs.
        lambda: browser.evaluate("() => location.href").endswith(f"/jobs/{failed}"),
        timeout=15,
        what="the failed job's page",
        procs=procs,
    )
    page = wait_for(
        lambda: (fields := shown(browser))["state"] == "failed" and fields,
        timeout=30,
        what="the failed job shown failed",
        procs=procs,
    )
    view = status(hsx, failed, None)
    assert page["reason"] == view["failure_reason"] and "dead-lettered" in page["reason"], (page, view)
    assert number(page["dead.letters"]) == view["dead_letters"] == 1, page
    assert page["dead.retry"] == f"hsx dead retry --job {failed} --all", page
    assert number(page["progress.samples_uploaded"]) == view["samples_uploaded"] == 5, page
    errors = browser.evaluate("() => document.getElementById('dead-errors').textContent")
    assert "sample 3" in errors, errors
    assert get_json(f"{base}/api/status?job={failed}")["failed"] is True
