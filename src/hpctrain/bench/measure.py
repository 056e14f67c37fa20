"""CPU time of this process, its finished children and live processes, for the benchmarks."""

from __future__ import annotations

import os
import resource
import time
from pathlib import Path


def cpu_seconds() -> float:
    """CPU of this process and of its finished children (pool workers are joined when done)."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def self_cpu_seconds() -> float:
    """CPU of this process alone."""
    me = resource.getrusage(resource.RUSAGE_SELF)
    return me.ru_utime + me.ru_stime


def process_cpu_seconds(pid: int) -> float:
    """CPU seconds of a live process, all its threads (ended ones too).

    Read from the kernel's CPU clock of the process (Linux: clock id `(~pid << 3) | 2`,
    CPUCLOCK_SCHED), in nanoseconds: /proc/<pid>/stat counts clock ticks (10 ms here), as
    coarse as a loader worker's whole epoch at the quick bench's sizes. Where that clock is
    refused, /proc/<pid>/stat's utime + stime.
    """
    try:
        return time.clock_gettime(((~pid) << 3) | 2)
    except (OSError, OverflowError):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
