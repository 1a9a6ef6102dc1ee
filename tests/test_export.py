"""`hsx export` loaded by the trainers' own readers (SpecForge 0.2.0 and speculators 0.9.0 from
the registry, installed `--no-deps` by make setup): three real jobs on an 8-layer tiny model, one
per format (`--layers dflash:3`, `eagle3` stored as float8, `speculators`), exported, then read
with SpecForge's offline reader, normalizer, collator and FeatureDataLoader and with speculators'
ArrowDataset (`on_missing="raise"`). Every sample the trainer can take is there with its token
ids; its tensors equal hsx's files (HiddenStateDataset) and what the trainers' own conventions
take from transformers' output (SpecForge's `extract_context_feature`: hidden_states[id + 1];
speculators: hidden_states[id] and the last layer before the final norm). Also: the sample
SpecForge's DFlash reader would crash on is left out and listed, a rerun resumes, a format the
job's layers cannot make is one line naming the preset, a damaged source file is named.
"""

import json
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from conftest import TINY, _env, run_in_process
from tolerance import U_BFLOAT16, assert_within, bfloat16_bound, depth, error, float8_bound

from hsx.commands.embedded import build_tiny_model
from hsx.exitcodes import JOB_FAILED
from hsx.job import FINAL
from hsx.storage.reader import HiddenStateDataset

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    specforge_registry = pytest.importorskip("specforge.algorithms.builtin", reason="specforge is a test extra")
    from specforge.modeling.draft.dflash import extract_context_feature
    from specforge.runtime.data_plane.feature_dataloader import FeatureDataLoader
    from specforge.runtime.data_plane.feature_store import LocalFeatureStore

    speculators_data = pytest.importorskip("speculators.train.data", reason="speculators is a test extra")

DEPTH = 8
# Distinct rows (the readers shuffle; a sample is found by its tokens). Row 3 has one token, row 4
# no two adjacent supervised ones: SpecForge's DFlash reader raises on both. Row 5 has no mask.
ROWS = [
    {"input_ids": [5, 9, 14, 3, 8, 21, 7], "loss_mask": [0, 0, 1, 1, 1, 1, 0]},
    {"input_ids": [11, 4, 6, 30, 2], "loss_mask": [0, 1, 1, 1, 1]},
    {"input_ids": [40, 41, 42, 43, 44, 45, 46, 47, 48], "loss_mask": [0, 0, 0, 1, 1, 0, 1, 1, 1]},
    {"input_ids": [17], "loss_mask": [1]},
    {"input_ids": [60, 61, 62, 63], "loss_mask": [1, 0, 1, 0]},
    {"input_ids": [70, 71, 72, 73, 74, 75]},
]
JOBS = {"dflash": ("dflash:3", "bfloat16"), "eagle3": ("eagle3", "float8"), "speculators": ("speculators", "bfloat16")}


def _hsx(args, url, *, timeout=120):
    with pytest.MonkeyPatch.context() as patch:
        return run_in_process(args, _env(url, None), patch, timeout=timeout)


@pytest.fixture(scope="module")
def jobs(nats_server, tmp_path_factory):
    """({kind: its job folder}, the model): the three jobs, done, in a file destination."""
    root = tmp_path_factory.mktemp("export")
    model = build_tiny_model(root / "qwen3-8", seed=3, **{**TINY["qwen3"], "num_hidden_layers": DEPTH})
    dataset = root / "rows.jsonl"
    dataset.write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    out, spool, stamp = root / "out", root / "spool", str(time.time_ns())[-6:]
    names = {kind: f"export-{kind}-{stamp}" for kind in JOBS}
    for kind, (layers, dtype) in JOBS.items():
        produced = _hsx(
            ["produce", "--job", names[kind], "--model", str(model), "--dataset", str(dataset),
             "--layers", layers, "--dest", str(out), "--dtype", dtype, "--token-budget", "64", "--max-seq-len", "16"],
            nats_server.url,
        )  # fmt: skip
        assert produced.returncode == 0, produced.stderr
    services = []
    for kind, job in names.items():
        for args in (["consume", "--device", "cpu"], ["upload"]):
            log = open(root / f"{kind}-{args[0]}.log", "wb")
            services.append(
                subprocess.Popen(
                    [sys.executable, "-m", "hsx.cli", *args, "--job", job, "--spool", str(spool / kind)],
                    env=_env(nats_server.url, None),
                    stdout=log,
                    stderr=log,
                )
            )
    try:
        deadline = time.monotonic() + 180
        pending = set(names.values())
        while pending and time.monotonic() < deadline:
            for job in list(pending):
                status = _hsx(["status", "--job", job, "--json"], nats_server.url)
                if status.returncode == 0 and json.loads(status.stdout)["done"]:
                    pending.discard(job)
            assert all(p.poll() is None for p in services), f"a service exited early (logs in {root})"
            time.sleep(0.5)
        assert not pending, f"jobs {pending} not done in 180 s (logs in {root})"
    finally:
        for process in services:
            process.terminate()
        for process in services:
            process.wait(60)
    return {kind: out / job for kind, job in names.items()}, model


def _export(source: Path, fmt: str, out: Path, *extra: str) -> subprocess.CompletedProcess:
    with pytest.MonkeyPatch.context() as patch:
        return run_in_process(
            ["export", str(source), "--to", fmt, str(out), *extra], _env(None, None), patch, timeout=120
        )


def _exported(source: Path, fmt: str, out: Path, *extra: str) -> dict:
    """`hsx export` that must succeed, and its report."""
    result = _export(source, fmt, out, *extra)
    assert result.returncode == 0, result.stderr
    return json.loads((out / "hsx-export.json").read_text())


def _reference(model: Path):
    """transformers' own output_hidden_states, and each decoder layer's raw output (a hook)."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    raw = {}
    last = reference.model.layers[-1]
    last.register_forward_hook(
        lambda _m, _i, output: raw.__setitem__("last", output[0] if isinstance(output, tuple) else output)
    )

    def run(ids: list[int]):
        with torch.no_grad():
            states = reference(torch.tensor([ids]), output_hidden_states=True).hidden_states
        return [s[0] for s in states], raw["last"][0]

    return run


def _hsx_items(folder: Path) -> dict[tuple[int, ...], dict]:
    dataset = HiddenStateDataset(str(folder))
    return {tuple(item["input_ids"].tolist()): item for item in (dataset[i] for i in range(len(dataset)))}


def _specforge_batches(algorithm: str, out: Path) -> list:
    provider = specforge_registry.builtin_algorithm_registry().resolve(algorithm).providers.offline_for("text")
    refs = provider.build_reader(str(out), run_id="hsx", ttt_length=1, max_len=2048).read()
    loader = FeatureDataLoader(
        LocalFeatureStore("hsx"),
        refs=refs,
        batch_size=1,
        collate_fn=provider.build_collator(),
        per_sample_transform=provider.build_normalizer(2048, ttt_length=1, use_usp_preprocess=False),
        drop_last=False,
        strategy=algorithm,
    )
    return list(loader)


def test_specforge_dflash_reads_the_export(jobs, tmp_path):
    folders, model = jobs
    out = tmp_path / "dflash"
    report = _exported(folders["dflash"], "specforge-dflash", out)
    assert report["trainer_layer_ids"] == {"target_layer_ids": [1, 3, 5]} and report["layers"] == [1, 3, 5]
    left = {entry["sample_index"] for entry in report["left_out"]}
    assert left == {3, 4} and report["samples_exported"] == 4 and not report["failed"]
    assert "no two consecutive supervised tokens" in report["left_out"][0]["reason"]
    assert [entry["source_id"] for entry in report["left_out"]] == ["3", "4"], report["left_out"]  # rows without id
    assert sorted(p.name for p in out.rglob("*.ckpt")) == [f"data_{i}.ckpt" for i in (0, 1, 2, 5)]
    assert all(p.parent.name == "rows_0-2000" for p in out.rglob("*.ckpt"))

    expected, reference = _hsx_items(folders["dflash"]), _reference(model)
    batches = _specforge_batches("dflash", out)
    assert len(batches) == 4
    for batch in batches:
        ids = tuple(batch.tensors["input_ids"][0].tolist())
        item = expected[ids]
        hidden = batch.tensors["hidden_states"][0]
        assert torch.equal(hidden, item["hidden_states"].reshape(len(ids), -1))
        mask = item.get("loss_mask", torch.ones(len(ids), dtype=torch.uint8))
        assert batch.tensors["loss_mask"][0].tolist() == mask.tolist()
        # SpecForge's own reading of transformers' output for these ids: hidden_states[id + 1],
        # within the bfloat16 bound (tests/tolerance.py: a bfloat16 job) of the deepest, layer 5;
        # the reading one layer off (hidden_states[id]) is not.
        states, _ = reference(list(ids))
        bound = bfloat16_bound(depth(5, DEPTH))
        assert_within(hidden, extract_context_feature(states, [1, 3, 5]), bound, f"dflash {ids}")
        assert error(hidden, extract_context_feature(states, [0, 2, 4])) > bound


def test_specforge_eagle3_reads_the_float8_export(jobs, tmp_path):
    folders, model = jobs
    out = tmp_path / "eagle3"
    report = _exported(folders["eagle3"], "specforge-eagle3", out)
    assert report["trainer_layer_ids"] == {"aux_hidden_state_layer_ids": [1, 3, 4]}
    assert report["samples_exported"] == len(ROWS) and not report["left_out"]
    expected, reference = _hsx_items(folders["eagle3"]), _reference(model)
    batches = _specforge_batches("eagle3", out)
    assert sorted(tuple(b.tensors["input_ids"][0].tolist()) for b in batches) == sorted(expected)
    assert report["dtype"] == "bfloat16"  # float8 is exported as bfloat16 unless --dtype says otherwise
    for batch in batches:
        ids = tuple(batch.tensors["input_ids"][0].tolist())
        # float8 dequantized by hsx's reader, then rounded to bfloat16: the exported values, exactly.
        item = expected[ids]["hidden_states"].to(torch.bfloat16)
        aux, target = (
            batch.tensors["hidden_state"][0],
            batch.tensors["target"][0],
        )  # SpecForge's names after its normalizer
        assert aux.dtype == target.dtype == torch.bfloat16
        assert torch.equal(aux, item[:, :3].reshape(len(ids), -1))
        assert torch.equal(target, item[:, 3])
        states, _ = reference(list(ids))
        # aux: decoder layers 1, 3, 4 = hidden_states[2, 4, 5]; target: the post-norm state, [-1].
        # Within tests/tolerance.py's float8 bound, and one bfloat16 rounding more (the export's).
        aux_bound = float8_bound(depth(4, DEPTH)) + U_BFLOAT16
        assert_within(aux, torch.cat([states[2], states[4], states[5]], -1), aux_bound, f"eagle3 aux {ids}")
        assert error(aux, torch.cat([states[1], states[3], states[4]], -1)) > aux_bound  # one layer off
        target_bound = float8_bound(depth(FINAL, DEPTH)) + U_BFLOAT16
        assert_within(target, states[-1], target_bound, f"eagle3 target {ids}")
        assert error(target, states[-2]) > target_bound  # the state before the norm


def test_dtype_is_chosen_and_an_export_folder_holds_one_export(jobs, tmp_path):
    """`--dtype float32` keeps the float8 job's dequantized values exactly; OUT then refuses to be
    resumed as another dtype, format or job (its files would be mixed), in one line."""
    folders, _ = jobs
    out = tmp_path / "eagle3-f32"
    report = _exported(folders["eagle3"], "specforge-eagle3", out, "--dtype", "float32")
    assert report["dtype"] == "float32" and report["samples_exported"] == len(ROWS)
    expected = _hsx_items(folders["eagle3"])
    for path in out.rglob("*.ckpt"):
        saved = torch.load(path, weights_only=False, mmap=True)
        item = expected[tuple(saved["input_ids"].tolist())]["hidden_states"]
        assert saved["hidden_state"].dtype == torch.float32 and torch.equal(saved["hidden_state"][0], item[:, 3])
    for source, fmt, extra in (
        (folders["eagle3"], "specforge-eagle3", ("--dtype", "bfloat16")),
        (folders["eagle3"], "specforge-eagle3", ()),  # auto: bfloat16 for a float8 job
        (folders["dflash"], "specforge-dflash", ("--dtype", "float32")),
    ):
        refused = _export(source, fmt, out, *extra)
        lines = [line for line in refused.stderr.splitlines() if line.startswith("hsx: error:")]
        assert refused.returncode == 2 and len(lines) == 1 and "holds the export of job" in lines[0], refused.stderr
    assert (
        _export(folders["eagle3"], "specforge-eagle3", out, "--dtype", "float32").returncode == 0
    )  # the same: resumed


def test_speculators_reads_the_export(jobs, tmp_path):
    folders, model = jobs
    out = tmp_path / "speculators"
    report = _exported(folders["speculators"], "speculators", out)
    assert report["trainer_layer_ids"] == {"target_layer_ids": [2, 4, 5]}  # speculators' ids: hsx's + 1
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # a token mismatch is only a warning there: make it fail
        dataset = speculators_data.ArrowDataset(max_len=64, datapath=str(out), on_missing="raise")
        items = [dataset[i] for i in range(len(dataset))]
    expected, reference = _hsx_items(folders["speculators"]), _reference(model)
    assert len(items) == len(ROWS) == len(expected)
    for row, item in enumerate(items):
        ids = tuple(item["input_ids"].tolist())
        assert ids == tuple(ROWS[row]["input_ids"])  # row i is sample i
        mine = expected[ids]["hidden_states"]
        assert torch.equal(item["hidden_states"], mine[:, :3].reshape(len(ids), -1))
        assert torch.equal(item["verifier_last_hidden_states"], mine[:, 3])
        assert item["loss_mask"].tolist() == ROWS[row].get("loss_mask", [1] * len(ids))
        states, last_raw = reference(list(ids))
        # speculators' ids index hidden_states directly; its last slot is the last layer before the
        # norm. Within tests/tolerance.py's bfloat16 bound (a bfloat16 job); one layer off is not.
        bound = bfloat16_bound(depth(4, DEPTH))
        ours = torch.cat([states[2], states[4], states[5]], -1)
        assert_within(item["hidden_states"], ours, bound, f"speculators {ids}")
        assert error(item["hidden_states"], torch.cat([states[1], states[3], states[4]], -1)) > bound
        last_bound = bfloat16_bound(depth(DEPTH - 1, DEPTH))
        assert_within(item["verifier_last_hidden_states"], last_raw, last_bound, f"speculators last {ids}")
        assert error(last_raw, states[-1]) > last_bound  # pre-norm is not the post-norm state
    collate = speculators_data.CollateFn(64, mine.shape[-1], num_target_layers=3, dtype=torch.bfloat16)
    batch = collate(items)
    assert batch["error_records"] == 0 and int((batch["document_ids"] >= 0).sum()) == sum(
        len(r["input_ids"]) for r in ROWS
    )


def test_a_rerun_resumes_and_a_format_the_layers_cannot_make_is_one_line(jobs, tmp_path):
    folders, _ = jobs
    out = tmp_path / "dflash"
    assert _export(folders["dflash"], "specforge-dflash", out).returncode == 0
    files = sorted(out.rglob("*.ckpt"))
    written = {p: p.stat().st_mtime_ns for p in files}
    files[0].unlink()
    again = _export(folders["dflash"], "specforge-dflash", out)
    assert again.returncode == 0, again.stderr
    assert sorted(out.rglob("*.ckpt")) == files
    assert all(p.stat().st_mtime_ns == written[p] for p in files[1:])  # kept, not rewritten
    for source, fmt, needle in (
        (folders["dflash"], "specforge-eagle3", "make the job with --layers eagle3"),
        (folders["eagle3"], "specforge-dflash", "make the job with --layers dflash:N"),
        (folders["dflash"], "speculators", "make the job with --layers speculators"),
    ):
        refused = _export(source, fmt, tmp_path / f"refused-{fmt}")
        lines = [line for line in refused.stderr.splitlines() if line.startswith("hsx: error:")]
        assert refused.returncode == 2 and len(lines) == 1 and needle in lines[0], refused.stderr
    nowhere = _export(tmp_path / "no-such-job", "speculators", tmp_path / "x")
    assert nowhere.returncode != 0 and "hsx: error:" in nowhere.stderr and "Traceback" not in nowhere.stderr


def test_a_damaged_source_file_is_named_and_the_rest_exported(jobs, tmp_path):
    folders, _ = jobs
    copy = tmp_path / "copy" / folders["speculators"].name
    shutil.copytree(folders["speculators"], copy)
    victim = next(copy.rglob("2.safetensors"))
    data = bytearray(victim.read_bytes())
    data[-3] ^= 0xFF  # a byte of the tensors: the checksum inside the file no longer matches
    victim.write_bytes(bytes(data))
    out = tmp_path / "speculators"
    result = _export(copy, "speculators", out)
    assert result.returncode == JOB_FAILED, result.stderr
    report = json.loads((out / "hsx-export.json").read_text())
    assert [entry["sample_index"] for entry in report["failed"]] == [2] and "damaged" in report["failed"][0]["reason"]
    assert "failed 1 samples (first: 2, damaged: " in result.stderr
    assert not (out / "state.json").exists()  # no table with a hole for speculators to trip on
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == len(ROWS) - 1
    shutil.copy(folders["speculators"] / victim.relative_to(copy), victim)  # mended: a rerun finishes
    assert _export(copy, "speculators", out).returncode == 0
    assert (out / "state.json").exists()
