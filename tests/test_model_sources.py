"""Where a model comes from: a local folder (every other test) or the local Hugging Face cache,
by id, with no network. An id that is neither is a one-line error naming it.

The cache here is laid out the way `huggingface_hub` writes one (`models--<org>--<name>/` with
`blobs/`, `snapshots/<commit>/` links into them, and `refs/main` holding the commit), under a
temporary `HF_HUB_CACHE`, with `HF_HUB_OFFLINE=1`; the real CLI is run against it.
"""

import hashlib
import json
import os

from safetensors import safe_open

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MODEL_ID = "hsx-test/tiny-qwen3"


def _hf_cache(root, model_id: str, folder) -> None:
    """A hub cache holding `folder`'s files as revision `main` of `model_id`."""
    org, name = model_id.split("/")
    repo = root / f"models--{org}--{name}"
    snapshot = repo / "snapshots" / COMMIT
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    for source in folder.iterdir():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / source.name)


def _offline_env(tmp_path, cache) -> dict:
    return {"HF_HOME": str(tmp_path / "hf-home"), "HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}


def test_a_model_id_resolves_from_the_local_hub_cache_offline(hsx, hsx_service, tiny_model, job_name, tmp_path):
    cache = tmp_path / "hub"
    _hf_cache(cache, MODEL_ID, tiny_model("qwen3"))
    env = _offline_env(tmp_path, cache)
    dataset = tmp_path / "data.jsonl"
    rows = [{"id": f"r{i}", "input_ids": list(range(3, 3 + 4 * (i + 1)))} for i in range(5)]
    dataset.write_text("".join(json.dumps(row) + "\n" for row in rows))
    out = tmp_path / "out"

    produced = hsx(
        "produce",
        "--job",
        job_name,
        "--model",
        MODEL_ID,
        "--dataset",
        str(dataset),
        "--layers",
        "1,-1",
        "--dest",
        str(out),
        "--dtype",
        "float32",
        "--token-budget",
        "64",
        "--max-seq-len",
        "32",
        env=env,
    )
    assert produced.returncode == 0, produced.stderr
    spool = str(tmp_path / "spool")
    consumer = hsx_service("consume", "--job", job_name, "--device", "cpu", "--spool", spool, env=env, name="consumer")
    hsx_service("upload", "--job", job_name, "--spool", spool, env=env, name="uploader")
    monitor = hsx("monitor", "--job", job_name, "--until-done", "--interval", "0.5", timeout=120)
    assert monitor.returncode == 0, (monitor.stdout + monitor.stderr)[-2000:] + consumer.log_path.read_text()[-2000:]

    # The start-up log says what was loaded: the cached snapshot's layers up to the deepest, 5 (all 6).
    loads = [json.loads(line) for line in consumer.log_path.read_text().splitlines() if '"model_loaded"' in line]
    assert [(r["model"], r["layers_loaded"], r["layers_total"], r["final_norm"]) for r in loads] == [
        (MODEL_ID, 6, 6, False)
    ], loads
    assert loads[0]["weight_bytes"] > 0 and loads[0]["placement"] == "direct"

    files = sorted(out.rglob("*.safetensors"))
    assert len(files) == len(rows)
    for path in files:
        with safe_open(path, framework="pt") as f:
            metadata = f.metadata()
            assert f.get_tensor("hidden_states").shape[1:] == (2, 64)
        # The id is what the job names, and the revision is the cache's commit: it came from there.
        assert metadata["model"] == MODEL_ID
        assert metadata["model_revision"] == COMMIT
        assert json.loads(metadata["layers"]) == [1, 5]


def test_an_unknown_model_id_is_a_one_line_error(hsx, job_name, tmp_path):
    cache = tmp_path / "empty-hub"
    cache.mkdir()
    dataset = tmp_path / "data.jsonl"
    dataset.write_text('{"input_ids": [1, 2, 3]}\n')
    result = hsx(
        "produce",
        "--job",
        job_name,
        "--model",
        "no-such-org/no-such-model",
        "--dataset",
        str(dataset),
        "--layers",
        "0",
        "--dest",
        str(tmp_path / "out"),
        env=_offline_env(tmp_path, cache),
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("hsx: error: model no-such-org/no-such-model:")
    assert "not a local folder" in lines[0] and "not in the local Hugging Face cache" in lines[0]
    assert "Traceback" not in result.stderr


def test_flash_attention_only_where_it_can_run():
    import torch

    from hsx.gpu_consumer.model import choose_attention

    cuda, cpu = torch.device("cuda:0"), torch.device("cpu")
    assert choose_attention(cuda, torch.bfloat16, flash_attn_installed=True) == "flash_attention_2"
    assert choose_attention(cuda, torch.float16, flash_attn_installed=True) == "flash_attention_2"
    assert choose_attention(cuda, torch.float32, flash_attn_installed=True) is None  # no float32 kernels
    assert choose_attention(cpu, torch.bfloat16, flash_attn_installed=True) is None
    assert choose_attention(cuda, torch.bfloat16, flash_attn_installed=False) is None
