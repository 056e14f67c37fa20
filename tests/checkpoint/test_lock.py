"""The run lock (checkpoint/lock.py): flock + lease record on local roots, lease on S3.

A second run is simulated in this process: a raw flock on the lock file, a record written by
hand, or a second `RunLock` (each has its own open file and token, as another process would).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import time
import uuid

import pytest
import torch

from hpctrain.checkpoint import CheckpointManager
from hpctrain.checkpoint.lock import LOCK_NAME, RunLock, holder_record, takeover_reason
from hpctrain.errors import EXIT_LOCKED, RunLockedError

ELSEWHERE = {"host": "node7", "pid": 4242, "job_id": "123", "restart": 0, "token": "t"}


def record(**changes):
    return {**ELSEWHERE, "since": time.time() - 60, "expires": time.time() + 60, **changes}


def write_record(root, rec) -> None:
    (root / LOCK_NAME).write_text(json.dumps(rec))


def test_a_live_flock_refuses_the_second_run_naming_the_holder(tmp_path):
    write_record(tmp_path, record(host="login1"))
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(RunLockedError) as info:
            RunLock(str(tmp_path)).acquire()
    finally:
        os.close(fd)
    message = str(info.value)
    assert info.value.exit_code == EXIT_LOCKED == 5
    for part in (str(tmp_path / LOCK_NAME), "host login1", "pid 4242", "SLURM job 123", "since"):
        assert part in message, message
    assert "\n" not in message


def test_flock_released_by_a_dead_holder_on_this_host_is_taken_over(tmp_path, caplog):
    write_record(tmp_path, record(host=holder_record()["host"]))  # no flock: the holder is gone
    lock = RunLock(str(tmp_path))
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        lock.acquire()
    # routine after a failed run (#49): a line in the log, not a warning
    [taken] = [r for r in caplog.records if "taking over" in r.getMessage()]
    assert taken.levelno == logging.INFO and "the holder on this host is gone" in taken.getMessage()
    try:
        on_disk = json.loads((tmp_path / LOCK_NAME).read_text())
        assert on_disk["token"] == lock.me["token"] and on_disk["pid"] == os.getpid()
        with pytest.raises(RunLockedError, match=rf"pid {os.getpid()}"):
            RunLock(str(tmp_path)).acquire()  # a second run while this one lives
    finally:
        lock.release()
    assert (tmp_path / LOCK_NAME).read_text() == ""  # released: no holder
    again = RunLock(str(tmp_path))
    again.acquire()
    again.release()


def test_a_live_lease_from_another_node_is_honoured_even_when_flock_is_granted(tmp_path):
    # Lustre with `localflock`: flock does not see the holder on node7; its record does.
    write_record(tmp_path, record())
    with pytest.raises(RunLockedError, match="host node7, pid 4242"):
        RunLock(str(tmp_path)).acquire()
    write_record(tmp_path, record(expires=time.time() - 1))  # it stopped renewing: gone
    lock = RunLock(str(tmp_path))
    lock.acquire()
    lock.release()


def test_takeover_rules():
    me = {**holder_record({"SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "1"}), "host": "n2"}
    now = time.time()
    assert takeover_reason(record(), me, now, flock_granted=True) is not None  # requeued job
    assert takeover_reason(record(), {**me, "restart": 0}, now, flock_granted=True) is None
    assert takeover_reason(record(job_id="9"), me, now, flock_granted=False) is None
    assert "expired" in str(takeover_reason(record(expires=now - 5), me, now, flock_granted=False))
    same_host = record(host="n2", job_id="9")
    assert takeover_reason(same_host, me, now, flock_granted=True) is not None
    assert takeover_reason(same_host, me, now, flock_granted=False) is None
    array = holder_record({"SLURM_ARRAY_JOB_ID": "5", "SLURM_ARRAY_TASK_ID": "2"})
    assert array["job_id"] == "5_2"


def test_the_lease_is_renewed_while_the_run_lives(tmp_path):
    lock = RunLock(str(tmp_path), lease_s=0.4)
    lock.acquire()
    try:
        first = json.loads((tmp_path / LOCK_NAME).read_text())["expires"]
        time.sleep(1.0)
        later = json.loads((tmp_path / LOCK_NAME).read_text())["expires"]
        assert later > first
    finally:
        lock.release()


def test_manager_fails_before_any_clean_up_when_locked(tmp_path):
    root = tmp_path / "ck"
    (root / ".tmp-step-7").mkdir(parents=True)  # the other run's save in progress
    host = holder_record()["host"]
    write_record(root, record(host=host))  # a run on this host
    fd = os.open(root / LOCK_NAME, os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        with pytest.raises(RunLockedError, match=f"host {host}, pid 4242"):
            CheckpointManager(str(root), keep_last=1)
    finally:
        os.close(fd)
    assert (root / ".tmp-step-7").is_dir()
    manager = CheckpointManager(str(root), keep_last=1)  # its flock is gone: taken over
    assert not (root / ".tmp-step-7").exists()
    manager.save(1, {"w": {"t": torch.ones(2)}})
    manager.close()
    assert (root / LOCK_NAME).read_text() == ""


@pytest.mark.network
def test_s3_lease_refuses_a_second_run_and_expires():
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.support.local_servers import moto_s3_server, s3_environment

    with moto_s3_server() as endpoint, s3_environment(endpoint):
        bucket = f"lock-{uuid.uuid4().hex[:12]}"
        fs = fsspec.filesystem("s3")
        fs.mkdir(bucket)
        root = f"s3://{bucket}/run/checkpoints"
        first = RunLock(root, lease_s=1.0, settle_s=0.1)
        first.acquire()
        with pytest.raises(RunLockedError) as info:
            RunLock(root, settle_s=0.1).acquire()
        assert f"{root}/{LOCK_NAME}" in str(info.value)
        assert f"pid {os.getpid()}" in str(info.value)
        first._stop.set()  # the holder freezes or dies: no more renewals
        time.sleep(1.2)
        second = RunLock(root, settle_s=0.1)
        second.acquire()  # its lease expired
        holder = json.loads(fs.cat_file(f"{bucket}/run/checkpoints/{LOCK_NAME}"))
        assert holder["token"] == second.me["token"]
        second.release()
        assert not fs.exists(f"{bucket}/run/checkpoints/{LOCK_NAME}")
        first._renewer = None
        first.release()  # no longer ours: leaves the store alone


def test_an_earlier_attempt_of_the_same_job_run_is_taken_over():
    """A restart inside the allocation (resilience/attempts.py): srun ended every task of attempt 1
    before attempt 2 began, wherever its rank 0 held the lock (another node, a live lease)."""
    env = {"SLURM_JOB_ID": "123", "SLURM_RESTART_COUNT": "1", "HPCTRAIN_ATTEMPT": "2"}
    me = {**holder_record(env), "host": "n2"}
    now = time.time()
    reason = takeover_reason(record(restart=1, attempt=1), me, now, flock_granted=False)
    assert reason == "it is attempt 1 of job 123, which ended before this one began"
    # the same attempt (two runs started by hand in one step), a later one, another job run
    for other in (record(restart=1, attempt=2), record(restart=1, attempt=3),
                  record(restart=2, attempt=1), record(restart=1)):  # fmt: skip
        assert takeover_reason(other, me, now, flock_granted=False) is None
