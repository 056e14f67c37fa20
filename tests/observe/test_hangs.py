"""Stack dumps of hung ranks (`hpctrain.observe.hangs`) and the NCCL flight recorder's settings,
in one process (the straggler check: test_step_metrics.py). The runs of several ranks are in
tests/faults/test_run_faults.py."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time

import pytest

from hpctrain.distributed.group import flight_recorder_env
from hpctrain.observe.hangs import (
    CollectiveTimeout,
    HangWatch,
    dump_folder,
    is_collective_timeout,
    newest_dump,
    write_dump,
)

GLOO_TIMEOUT = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
    "Timed out waiting 10000ms for recv operation to complete"
)


def test_ranks_dumping_together_share_a_folder_and_a_second_dump_gets_a_new_one(tmp_path):
    now = time.time()
    first = dump_folder(tmp_path, 0, now)
    (first / "rank-0.txt").write_text("")
    assert dump_folder(tmp_path, 1, now + 5) == first  # a peer, seconds later: same folder
    again = dump_folder(tmp_path, 0, now)  # rank 0 again, in the same second
    assert again != first and again.parent == first.parent
    (again / "rank-0.txt").write_text("")
    assert dump_folder(tmp_path, 1, now + 5) == again  # the newest dump, not the older one
    later = dump_folder(tmp_path, 1, now + 300)  # long after: a new hang
    assert later not in (first, again)


def waiting_for_the_peer(event: threading.Event) -> None:
    event.wait(30)


def test_a_dump_names_every_threads_frames_and_the_call_that_timed_out(tmp_path):
    event = threading.Event()
    thread = threading.Thread(target=waiting_for_the_peer, args=(event,))
    thread.start()
    try:
        try:
            raise RuntimeError(GLOO_TIMEOUT)
        except RuntimeError as exc:
            folder = write_dump(tmp_path, 3, "a collective timed out", exc)
    finally:
        event.set()
        thread.join()
    text = (folder / "rank-3.txt").read_text()
    assert folder.parent == tmp_path / "hangs"
    assert text.startswith("rank 3 on ") and "a collective timed out" in text
    assert "Timed out waiting 10000ms" in text  # the traceback of the failed call
    assert "waiting_for_the_peer" in text  # the other thread, from faulthandler
    assert newest_dump(tmp_path) == folder
    assert newest_dump(tmp_path, since=time.time() + 60) is None


def test_timeouts_are_told_from_other_errors():
    assert is_collective_timeout(RuntimeError(GLOO_TIMEOUT))
    wrapped = ValueError("checkpoint save failed")
    wrapped.__cause__ = RuntimeError(GLOO_TIMEOUT)
    assert is_collective_timeout(wrapped)
    assert not is_collective_timeout(RuntimeError("CUDA out of memory"))
    assert not is_collective_timeout(ValueError("data.timeout_s must be > 0"))  # not torch's
    # a chain that loops (an error whose cause's context is itself) ends: it hung the data errors
    looping = OSError("shard not found")
    cause = OSError("read failed")
    looping.__cause__, cause.__context__ = cause, looping
    assert not is_collective_timeout(looping)


def test_a_timed_out_collective_becomes_one_line_naming_the_dump(tmp_path):
    watch = HangWatch(tmp_path, 0, collective_timeout_s=10)
    watch.report_timeout(ValueError("not a hang"))  # returns: the caller re-raises it
    with pytest.raises(CollectiveTimeout) as caught:
        watch.report_timeout(RuntimeError(GLOO_TIMEOUT))
    folder = newest_dump(tmp_path)
    assert folder is not None and (folder / "rank-0.txt").is_file()
    message = str(caught.value)
    assert "train.collective_timeout_s=10 s" in message and str(folder) in message
    assert "\n" not in message


def main_thread_busy_in_a_step(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.01)


def test_sigusr1_dumps_while_the_main_thread_works_on(tmp_path):
    watch = HangWatch(tmp_path, 0)
    previous = signal.getsignal(signal.SIGUSR1)
    watch.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        main_thread_busy_in_a_step(2.0)  # still running: the signal did not stop it
        folder = newest_dump(tmp_path)
        assert folder is not None, "no dump after SIGUSR1"
        text = (folder / "rank-0.txt").read_text()
        assert "SIGUSR1 received" in text and "main_thread_busy_in_a_step" in text
    finally:
        watch.uninstall()
    assert signal.getsignal(signal.SIGUSR1) == previous


def test_usr1_stays_a_preemption_signal_where_the_user_made_it_one(tmp_path, caplog):
    watch = HangWatch(tmp_path, 0, dump_on_usr1=False)
    previous = signal.getsignal(signal.SIGUSR1)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        watch.install()
    try:
        assert signal.getsignal(signal.SIGUSR1) == previous  # preemption's handler, untouched
        assert "SIGUSR1 is a preemption signal" in caplog.text
    finally:
        watch.uninstall()


def test_the_flight_recorder_is_set_unless_the_user_set_it(tmp_path):
    env = flight_recorder_env(
        {"SLURM_JOB_ID": "42", "SLURM_RESTART_COUNT": "1", "MASTER_PORT": "20042"}, tmp_path
    )
    assert env == {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": "2000",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(tmp_path / "nccl" / "42-1-20042-rank-"),
    }
    mine = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "0", "MASTER_PORT": "29500"}
    env = flight_recorder_env(mine, tmp_path)
    assert "TORCH_NCCL_TRACE_BUFFER_SIZE" not in env  # the user's choice stays
    assert env["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "nccl" / "local-29500-rank-")


def test_status_points_to_the_dumps_and_the_last_straggler_line(tmp_path, monkeypatch, capsys):
    from hpctrain.cli.main import main
    from hpctrain.launch import status as status_mod

    (tmp_path / "slurm").mkdir()
    (tmp_path / "slurm" / "job_id").write_text("3\n")
    (tmp_path / "slurm" / "3.out").write_text(
        "12:00:01 [rank 0] WARNING straggler: rank 1 on n1 computes 150 ms per step\n"
        "12:00:09 [rank 0] WARNING straggler: rank 3 on n2 computes 170 ms per step\n"
        "step 30 loss 0.1\n"
    )
    folder = write_dump(tmp_path, 0, "SIGUSR1 received: training goes on")
    # No SLURM cluster in this test: sacct's answers are stand-ins.
    monkeypatch.setattr(status_mod, "query_state", lambda job_id: ("RUNNING", "0:0", 0))
    monkeypatch.setattr(status_mod, "query_jobs", lambda job_ids: [])
    assert main(["status", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert f"stacks:    {folder}  (Python stacks of hung ranks; docs/checkpoints.md)" in out
    assert "straggler: 12:00:09 [rank 0] WARNING straggler: rank 3 on n2 computes 170 ms" in out


FIRST_STEP = """
import sys, time
from pathlib import Path
from hpctrain.observe.hangs import HangWatch
watch = HangWatch(Path(sys.argv[1]), 0, step_timeout_s=0.5, first_step_timeout_s=float(sys.argv[2]))
watch.install()
with watch.step(1):
    time.sleep(2.0)  # the first step: it compiles
print("first step done", flush=True)
with watch.step(2):
    time.sleep(60)  # a hang
"""


@pytest.mark.slow  # subprocesses: the step deadline ends the process it runs in
@pytest.mark.parametrize("first_step_timeout_s", [0.0, 10.0])
def test_the_first_step_has_its_own_allowance(tmp_path, first_step_timeout_s):
    """`train.step_timeout_s` counted the first step, which compiles: a compiled run with a
    tight step deadline died in its first step. Untimed (0) or with its own allowance, the
    first step finishes and the second one's hang is still caught."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FIRST_STEP, str(tmp_path), str(first_step_timeout_s)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert done.stdout == "first step done\n"
    assert "hang error: no training step finished within train.step_timeout_s=0.5 s (step 2 " in (
        done.stderr
    )


@pytest.mark.slow  # a subprocess: the step deadline ends the process it runs in
def test_a_first_step_over_its_allowance_is_named_as_such(tmp_path):
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", FIRST_STEP, str(tmp_path), "1"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and done.stdout == "", done.stderr[-2000:]
    assert (
        "hang error: no training step finished within train.first_step_timeout_s=1 s "
        "(step 1, the first of this process, ran 1 s)"
    ) in done.stderr
