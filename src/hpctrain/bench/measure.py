"""CPU time of this process, its finished children and live processes, for the benchmarks."""

from __future__ import annotations

import os
import resource
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
    """CPU seconds of a live process (utime + stime from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
