"""World discovery: SLURM (IDRIS-style), torchrun, or a single process → one `DistEnv`.

This is the only place that turns SLURM variables into `env://` rendezvous settings, like
submitit's `TorchDistributedEnvironment`, but without calling `scontrol` (missing on some
compute nodes and in containers: submitit#1601, pyxis#129).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

# srun's own ports (SrunPortRange on the dev cluster, and common site settings) live in
# 60001-63000; MASTER_PORT derived from the job id stays in 20000-29999, apart from them and
# below the Linux ephemeral range (32768+).
PORT_BASE = 20000
PORT_SPAN = 10000
# `NODE=ADDRESS`: the first training node's address on the fabric, from its health probe
# (`resilience/attempts.py place` exports it; distributed/interfaces.py)
FABRIC_MASTER_ENV = "HPCTRAIN_FABRIC_MASTER"


@dataclass(frozen=True)
class DistEnv:
    """Where this process sits in the job."""

    rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    master_addr: str
    master_port: int
    source: str  # "slurm", "torchrun" or "single"
    job_id: str = ""
    master_from: str = "MASTER_ADDR"  # where master_addr came from (the start-up log says)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


_RANGE_BODY = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: `a[1-2],b` → [`a[1-2]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"hostlist {text!r}: unbalanced ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"hostlist {text!r}: unbalanced '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_one(pattern: str) -> list[str]:
    open_at = pattern.find("[")
    if open_at < 0:
        return [pattern]
    close_at = pattern.index("]", open_at)
    prefix, body, rest = pattern[:open_at], pattern[open_at + 1 : close_at], pattern[close_at + 1 :]
    values: list[str] = []
    for item in body.split(","):
        match = _RANGE_BODY.match(item)
        if match is None:
            raise ValueError(f"hostlist {pattern!r}: bad range {item!r}")
        low, high = match.group(1), match.group(2)
        if high is None:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"hostlist {pattern!r}: range {item!r} runs backwards")
        width = len(low)  # zero padding follows the lower bound, as SLURM does
        values.extend(str(n).zfill(width) for n in range(int(low), int(high) + 1))
    return [f"{prefix}{v}{tail}" for v in values for tail in _expand_one(rest)]


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list: `jz[001-003,010],jzb5` → jz001 jz002 jz003 jz010 jzb5."""
    hosts: list[str] = []
    for part in _split_top_level(text.strip()):
        hosts.extend(_expand_one(part))
    return hosts


def port_from_job_id(job_id: str) -> int:
    """A rendezvous port derived from the job id, the same on every node of the job."""
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def _int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(
            f"environment variable {name}={environ[name]!r} is not an integer"
        ) from None


def resolve_env(environ: Mapping[str, str] | None = None) -> DistEnv:
    """Resolve this process's rank and rendezvous from the environment.

    Order: torchrun/`hpctrain train --nproc` variables (RANK and WORLD_SIZE set) win, then
    SLURM when this process is a task of a step (`SLURM_PROCID` and `SLURM_NTASKS`), else a
    single process. MASTER_ADDR/MASTER_PORT already in the environment are kept.
    """
    env = os.environ if environ is None else environ
    if "RANK" in env and "WORLD_SIZE" in env:
        world_size = _int(env, "WORLD_SIZE")
        return DistEnv(
            rank=_int(env, "RANK"),
            local_rank=_int(env, "LOCAL_RANK") if "LOCAL_RANK" in env else 0,
            world_size=world_size,
            local_world_size=_int(env, "LOCAL_WORLD_SIZE")
            if "LOCAL_WORLD_SIZE" in env
            else world_size,
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
            source="torchrun",
            job_id=env.get("SLURM_JOB_ID", ""),
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        job_id = env.get("SLURM_JOB_ID", "0")
        nodelist = (
            env.get("SLURM_STEP_NODELIST")
            or env.get("SLURM_JOB_NODELIST")
            or env.get("SLURM_NODELIST", "")
        )
        hosts = expand_hostlist(nodelist) if nodelist else ["127.0.0.1"]
        num_tasks = _int(env, "SLURM_NTASKS")
        local_tasks = env.get("SLURM_NTASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE", "")
        local_world_size = (
            _int(env, "SLURM_NTASKS_PER_NODE")
            if "SLURM_NTASKS_PER_NODE" in env
            else _first_count(local_tasks, num_tasks)
        )
        return DistEnv(
            rank=_int(env, "SLURM_PROCID"),
            local_rank=_int(env, "SLURM_LOCALID") if "SLURM_LOCALID" in env else 0,
            world_size=num_tasks,
            local_world_size=local_world_size,
            master_addr=env["MASTER_ADDR"] if "MASTER_ADDR" in env else master_of(env, hosts),
            master_port=_int(env, "MASTER_PORT")
            if "MASTER_PORT" in env
            else port_from_job_id(job_id),
            source="slurm",
            job_id=job_id,
            master_from=master_source(env, hosts),
        )
    return DistEnv(
        rank=0,
        local_rank=0,
        world_size=1,
        local_world_size=1,
        master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(env, "MASTER_PORT") if "MASTER_PORT" in env else 29500,
        source="single",
    )


def fabric_master(environ: Mapping[str, str], first_node: str) -> str:
    """The first node's fabric address its probe recorded, when it is that node's ("")."""
    node, _, address = environ.get(FABRIC_MASTER_ENV, "").partition("=")
    return address if address and node == first_node else ""


def master_of(environ: Mapping[str, str], hosts: list[str]) -> str:
    """The master address of a SLURM step: rank 0's node (the first of the step's nodes),
    at its fabric address when its probe found one."""
    return fabric_master(environ, hosts[0]) or hosts[0]


def master_source(environ: Mapping[str, str], hosts: list[str]) -> str:
    """Where a SLURM step's master address comes from, in words."""
    if "MASTER_ADDR" in environ:
        return "MASTER_ADDR"
    if fabric_master(environ, hosts[0]):
        return f"{hosts[0]}'s fabric address, from its health probe"
    return "the step's first node"


def _first_count(tasks_per_node: str, fallback: int) -> int:
    """`2(x3),1` → 2: SLURM_TASKS_PER_NODE's count for the first node."""
    match = re.match(r"^(\d+)", tasks_per_node)
    return int(match.group(1)) if match else fallback
