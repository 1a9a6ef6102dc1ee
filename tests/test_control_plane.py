"""The cheaper per-sample paths of issue 11 item 4: a file:// destination on the spool's file
system takes a checked spool file by a rename (the very inode checked, nothing copied); the
consumer announces a batch's files with their acks awaited together, each stored once."""

import asyncio
import os
from pathlib import Path

import pytest
import torch
from test_fidelity import _spec as fidelity_spec

from hsx.job import JobSpec
from hsx.storage import samplefile
from hsx.storage.destinations import VerificationError
from hsx.storage.destinations.file import FileDestination, FolderSync
from hsx.storage.layout import sample_key
from hsx.storage.spool import spool_file
from hsx.uploader.config import UploaderConfig
from hsx.uploader.service import FileMover, _SpoolFileLost
from hsx.wire import schemas, topology
from hsx.wire.jetstream import publish_all
from hsx.wire.natsconn import NatsSettings, connect


def _spec(job: str) -> JobSpec:
    return fidelity_spec(job, Path("m"), [1], "float32", [])


def _spool_file(spool, job: str, index: int) -> schemas.FileReady:
    path = spool_file(spool, job, _spec(job).plan_tag, index)
    tensors = {
        "hidden_states": torch.arange(64, dtype=torch.float32).reshape(4, 16) + index,
        "input_ids": torch.arange(4, dtype=torch.int64),
    }
    size, digest = samplefile.write(path, tensors, {"job": job})
    return schemas.FileReady(
        job=job,
        node="n",
        batch_id="b",
        sample_index=index,
        num_tokens=4,
        spool_path=str(path.relative_to(spool)),
        key=sample_key(job, index),
        size=size,
        digest=digest,
    )


def _mover(tmp_path, job: str) -> FileMover:
    cfg = UploaderConfig(
        nats=NatsSettings(url="nats://127.0.0.1:1"), job=job, spool=tmp_path / "spool", node="n", instance="u"
    )
    return FileMover(cfg, FileDestination(tmp_path / "dest"), events=None, spec=_spec(job))


def test_same_file_system_upload_is_the_checked_inode(tmp_path):
    mover = _mover(tmp_path, "job")
    ready = _spool_file(tmp_path / "spool", "job", 7)
    local = tmp_path / "spool" / ready.spool_path
    inode = local.stat().st_ino
    try:
        assert mover._move(ready) is False
        stored = tmp_path / "dest" / ready.key
        # Renamed, not copied: the stored file is the inode the consumer wrote, the spool holds none.
        assert stored.stat().st_ino == inode
        assert not local.exists()
        assert mover.dest.has_verified(ready.key, size=ready.size, digest=ready.digest)
        # Announced again (a redelivered batch): acked as already there, nothing lost.
        assert mover._move(ready) is True
    finally:
        mover.close()


def test_corrupt_spool_file_is_not_moved(tmp_path):
    mover = _mover(tmp_path, "job")
    ready = _spool_file(tmp_path / "spool", "job", 3)
    local = tmp_path / "spool" / ready.spool_path
    data = bytearray(local.read_bytes())
    data[-1] ^= 0xFF
    local.write_bytes(bytes(data))
    try:
        with pytest.raises(_SpoolFileLost):
            mover._move(ready)
        assert not (tmp_path / "dest" / ready.key).exists()
    finally:
        mover.close()


def test_move_refuses_a_file_that_is_not_the_checked_one(tmp_path):
    dest = FileDestination(tmp_path / "dest")
    ready = _spool_file(tmp_path / "spool", "job", 1)
    local = tmp_path / "spool" / ready.spool_path
    checked = os.stat(local)
    _spool_file(tmp_path / "spool", "job", 1)  # replaced after the check (a new inode, as atomic writes make)
    with pytest.raises(VerificationError):
        dest.move_verified(local, ready.key, size=ready.size, checked=checked)


def test_folder_sync_covers_every_caller(tmp_path):
    sync = FolderSync()
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda _: sync.sync(tmp_path), range(64)))
    assert sync._done[tmp_path] == 64 and not sync._running


def test_publish_all_stores_each_message_once(nats_server, job_name):
    async def main():
        nc = await connect(NatsSettings(url=nats_server.url), name="test-publish-all")
        js = nc.jetstream()
        await topology.ensure_topology(js)
        subject = topology.file_subject(job_name, "n")
        messages = [(subject, f"{i}".encode(), {"Nats-Msg-Id": f"{job_name}:{i}"}) for i in range(300)]
        await publish_all(js, messages, what="test")
        await publish_all(js, messages[:50], what="test")  # a repeat (redelivered batch) adds nothing
        info = await js.stream_info(topology.FILES_STREAM, subjects_filter=subject)
        await nc.close()
        return info.state.subjects.get(subject, 0)

    assert asyncio.run(main()) == 300
