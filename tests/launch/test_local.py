"""The local launcher's exit reporting (the runs themselves: tests/faults/test_run_faults.py)."""

from __future__ import annotations

import os
import signal

from hpctrain.launch.local import describe_exit, is_stopped, shell_code


def test_exit_codes_read_like_a_shell():
    assert describe_exit(1, -signal.SIGKILL) == "rank 1 killed by SIGKILL"
    assert describe_exit(0, 1) == "rank 0 exited with code 1"
    assert describe_exit(3, -200) == "rank 3 killed by signal 200"
    assert shell_code(-signal.SIGKILL) == 137 and shell_code(-signal.SIGTERM) == 143
    assert shell_code(75) == 75 and shell_code(0) == 0


def test_is_stopped_reads_the_process_state():
    assert not is_stopped(os.getpid())
    assert not is_stopped(2**22 + 1)  # no such process
