"""CPU time of other processes, as the loader benchmarks read their workers'."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from hpctrain.bench.measure import process_cpu_seconds


def _spin(seconds: float) -> None:
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        pass


def test_a_live_process_cpu_counts_its_ended_threads_finer_than_clock_ticks():
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker: a thread that spins and ends, then waits to be read
        thread = threading.Thread(target=_spin, args=(0.15,))
        thread.start()
        thread.join()
        _spin(0.05)
        os.write(ready_w, b"x")
        time.sleep(30)
        os._exit(0)
    try:
        os.read(ready_r, 1)
        cpu = process_cpu_seconds(pid)
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        ticks = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        assert cpu >= 0.2  # the ended thread's time included
        assert abs(cpu - ticks) <= 0.05  # the same time as /proc counts, to its ticks
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
