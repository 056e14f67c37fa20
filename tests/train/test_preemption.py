"""PreemptionFlag: the handler only records; the deadline; the armed exit after the save.

Ranks agree in `Trainer.agree_on_flags`, covered end to end in
tests/checkpoint/test_resume_e2e.py (a signal to some ranks, then a bitwise-identical resume)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from hpctrain.train.preemption import (
    REQUEUE_EXIT_CODE,
    PreemptionFlag,
    job_deadline,
    parse_signal,
)


def test_parse_signal():
    assert parse_signal("USR2") is signal.SIGUSR2
    assert parse_signal("sigterm") is signal.SIGTERM
    assert parse_signal("10") is signal.SIGUSR1
    with pytest.raises(ValueError, match=r"checkpoint\.signals: unknown signal 'NOPE'"):
        parse_signal("NOPE")
    assert REQUEUE_EXIT_CODE == 75


def test_signal_sets_the_flag_and_a_second_one_changes_nothing():
    flag = PreemptionFlag(["USR2", "TERM"])
    before = signal.getsignal(signal.SIGUSR2)
    flag.install()
    try:
        assert not flag.requested
        os.kill(os.getpid(), signal.SIGUSR2)
        assert flag.requested and flag._received is signal.SIGUSR2
        os.kill(os.getpid(), signal.SIGTERM)  # e.g. during the save: still only a flag
        assert flag.requested and flag._received is signal.SIGUSR2
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGUSR2) is before


def test_deadline_from_slurm_job_end_time():
    assert job_deadline({"SLURM_JOB_END_TIME": "1000"}, 180) == 820
    assert job_deadline({"SLURM_JOB_END_TIME": "1000"}, 0) is None
    assert job_deadline({}, 180) is None
    assert job_deadline({"SLURM_JOB_END_TIME": "0"}, 180) is None
    assert job_deadline({"SLURM_JOB_END_TIME": "soon"}, 180) is None
    now = [800.0]
    flag = PreemptionFlag(
        ["USR2"], 180, environ={"SLURM_JOB_END_TIME": "1000"}, clock=lambda: now[0]
    )
    assert not flag.requested
    now[0] = 821.0
    assert flag.requested


def test_after_the_requeue_save_a_signal_exits_with_the_requeue_code():
    """srun --kill-on-bad-exit=1 sends TERM to ranks still tearing down after the first one
    exited 75: they must exit 75 too, or srun returns 143 and the job is not requeued."""
    code = (
        "import os, signal, time\n"
        "from hpctrain.train.preemption import PreemptionFlag\n"
        "flag = PreemptionFlag(['USR2'])\n"
        "flag.install()\n"
        "flag.exit_on_signal(75)\n"
        "flag.uninstall()  # the trainer's finally: the armed handlers stay\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr


def test_ctrl_c_is_an_interrupt_not_a_preemption_unless_configured_as_one():
    flag = PreemptionFlag(["USR2", "TERM"])
    before = signal.getsignal(signal.SIGINT)
    flag.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert flag.interrupted and not flag.requested
    finally:
        flag.uninstall()
    assert signal.getsignal(signal.SIGINT) is before
    preempt = PreemptionFlag(["INT"])  # checkpoint.signals: [INT] makes ^C a requeue signal
    preempt.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)
        assert preempt.requested and not preempt.interrupted
    finally:
        preempt.uninstall()


def test_a_second_ctrl_c_ends_the_process_at_once_with_130_and_one_line():
    code = (
        "import os, signal, time\n"
        "from hpctrain.train.preemption import PreemptionFlag\n"
        "flag = PreemptionFlag(['USR2'], interrupt_line='stopped at once\\n')\n"
        "flag.install()\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "assert flag.interrupted\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 130 and proc.stderr == "stopped at once\n", proc.stderr
