"""A rendezvous that cannot silently split: the checks before a SLURM job's first collective.

Other trainers' users report multi-node runs where every node formed a world of its own (a
container that passed no `SLURM_PROCID`, `MASTER_ADDR` falling back to localhost) and trained
on, or hung, without a word. Before the process group is made, each task checks its own view
against SLURM's (no collective needed: `check_world`, `check_master`), then the rendezvous
store's first exchange compares every task's view with rank 0's (`agree_on_view`). Any
mismatch is one line naming what this node saw and what it should have, a launch error
(exit 6: not retried, the job's settings are wrong), on the tasks that see it; srun then ends
the step.

- the world size equals the step's tasks (`SLURM_NTASKS`; times `LOCAL_WORLD_SIZE` under a
  launcher of its own per task: torchrun, `hpctrain train --nproc`);
- rank 0, which serves the store, owns the master address (it resolves to an address of its
  node: a `MASTER_ADDR` exported from the batch shell names the batch host, which may be a
  spare or a node set aside);
- no other node resolves the master address to an address of its own (loopback, or the node
  itself: a wrapper's `MASTER_ADDR=$(hostname)` on every node) while rank 0's node is elsewhere;
- every task that reaches the store belongs to the same job step and world as rank 0 (a port
  shared with another job's rendezvous).

Stdlib only: the store is any object with torch's `Store` methods (set, get, add, wait, check).
"""

from __future__ import annotations

import json
import socket
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from hpctrain.distributed.env import DistEnv, expand_hostlist
from hpctrain.distributed.interfaces import this_node
from hpctrain.errors import LaunchFailure

PER_TASK_LAUNCHERS = ("TORCHELASTIC_RUN_ID", "HPCTRAIN_LAUNCHER")  # torchrun, --nproc
_PREFIX = "hpctrain/rendezvous/"


class RendezvousError(LaunchFailure):
    """The tasks of a step would not form one world: one line naming what this node saw."""

    def __init__(self, message: str) -> None:
        super().__init__(f"rendezvous: {message}")


class Store(Protocol):
    def set(self, key: str, value: str) -> None: ...
    def get(self, key: str) -> bytes: ...
    def add(self, key: str, value: int) -> int: ...
    def wait(self, keys: list[str]) -> None: ...
    def check(self, keys: list[str]) -> bool: ...


def in_slurm_step(environ: Mapping[str, str]) -> bool:
    """A task of a job step (srun sets SLURM_STEP_ID; the batch shell itself has none)."""
    return bool(environ.get("SLURM_STEP_ID") and environ.get("SLURM_JOB_ID"))


def step_nodes(environ: Mapping[str, str]) -> list[str]:
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    return expand_hostlist(nodelist) if nodelist else []


def _where(env: DistEnv, environ: Mapping[str, str]) -> str:
    return f"rank {env.rank} on {this_node(environ)}"


def check_world(env: DistEnv, environ: Mapping[str, str]) -> None:
    """The world this task joins is the step's: its size is SLURM's count of tasks.

    Raises:
        RendezvousError: a task that would train in a world of its own (or a wrong size).
    """
    if not in_slurm_step(environ) or not environ.get("SLURM_NTASKS", "").isdigit():
        return
    tasks = int(environ["SLURM_NTASKS"])
    launcher = next((name for name in PER_TASK_LAUNCHERS if environ.get(name)), "")
    per_task = env.local_world_size if launcher else 1
    if env.world_size == tasks * per_task:
        return
    if env.source == "single":
        why = "SLURM_PROCID is not set in this task's environment (a container that does not pass SLURM's variables?)"
    elif env.source == "torchrun":
        why = f"WORLD_SIZE={environ.get('WORLD_SIZE')} is set in the task's environment"
    else:
        why = f"SLURM says {env.world_size}"  # cannot happen: kept for a readable line
    expected = f"{tasks} x {per_task} ({launcher} runs {per_task} per task)" if launcher else tasks
    raise RendezvousError(
        f"SLURM_NTASKS={tasks} in job {environ['SLURM_JOB_ID']} step {environ['SLURM_STEP_ID']} "
        f"but {_where(env, environ)} sees a world of {env.world_size} ({why}); "
        f"the world must be {expected}: every task would otherwise train apart or wait for "
        "others that never come"
    )


Resolver = Callable[[str], set[str]]


def resolve(name: str) -> set[str]:
    """The addresses `name` resolves to here (IPv4 and IPv6)."""
    return {str(info[4][0]) for info in socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)}


def is_local(address: str) -> bool:
    """`address` belongs to this node: a socket can bind to it (loopback always can)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.bind((address, 0))
    except OSError:
        return False
    return True


def _resolved(name: str, what: str, resolver: Resolver, node: str) -> set[str] | None:
    """The addresses of `name`; None when the resolver failed only for now (EAI_AGAIN)."""
    try:
        return resolver(name)
    except socket.gaierror as exc:
        if exc.errno == socket.EAI_AGAIN:
            return None  # a resolver that is down for now: torch's own retries decide
        raise RendezvousError(f"{what}={name} does not resolve on {node}: {exc.strerror}") from None
    except (UnicodeError, ValueError) as exc:
        raise RendezvousError(f"{what}={name!r} is not a host name: {exc}") from None


def check_master(
    env: DistEnv,
    environ: Mapping[str, str],
    *,
    resolver: Resolver = resolve,
    local: Callable[[str], bool] = is_local,
) -> None:
    """Every node names the same master, and rank 0 owns it (see the module doc).

    Only for worlds SLURM describes (`env.source == "slurm"`): torchrun and `--nproc` bring
    their own rendezvous.

    Raises:
        RendezvousError: the line naming this node's view and the step's first node's.
    """
    if env.source != "slurm" or not env.is_distributed:
        return
    nodes = step_nodes(environ)
    node = this_node(environ)
    given = "MASTER_ADDR" if "MASTER_ADDR" in environ else "the master address"
    master = _resolved(env.master_addr, given, resolver, node)
    if master is None:
        return
    here = sorted(a for a in master if local(a))
    shown = f"{given}={env.master_addr} ({', '.join(sorted(master))})"
    if env.rank == 0 and not here:
        raise RendezvousError(
            f"{shown} is no address of {node}, where rank 0 serves the rendezvous store: the "
            "other tasks would wait for a store nobody serves; unset MASTER_ADDR (hpctrain "
            f"takes the step's first node{f', {nodes[0]}' if nodes else ''}) or name rank 0's node"
        )
    if env.rank == 0 or len(nodes) < 2 or not here or node == nodes[0]:
        return
    first = _resolved(nodes[0], "the first node", resolver, node)
    if first is None or any(local(a) for a in first):
        return  # rank 0's node is this machine too (nodes of one host, as a dev cluster's)
    what = "loopback" if all(_loopback(a) for a in here) else f"an address of {node} itself"
    raise RendezvousError(
        f"{shown} on {node} is {what}, but rank 0 runs on {nodes[0]} "
        f"({', '.join(sorted(first))}) in a job of {len(nodes)} nodes: the tasks of {node} "
        f"would wait for a rendezvous of their own; unset MASTER_ADDR or set it to {nodes[0]}"
    )


def _loopback(address: str) -> bool:
    return address.startswith("127.") or address == "::1"


def view_of(env: DistEnv, environ: Mapping[str, str]) -> dict[str, Any]:
    """What this task believes about its world, as the store's first exchange compares it."""
    return {
        "node": this_node(environ),
        "rank": env.rank,
        "job": environ.get("SLURM_JOB_ID", ""),
        "step": environ.get("SLURM_STEP_ID", ""),
        "world_size": env.world_size,
        "master": f"{env.master_addr}:{env.master_port}",
    }


def _describe(view: Mapping[str, Any]) -> str:
    job = f"job {view['job']} step {view['step']}, " if view["job"] else ""
    return f"{job}world {view['world_size']}, master {view['master']}"


def agree_on_view(store: Store, env: DistEnv, environ: Mapping[str, str]) -> None:
    """The store's first exchange: rank 0 publishes its view, every task compares its own.

    A task that disagrees (another job's task that reached this store through a shared port,
    a different world size) says so in the store and fails; the others wait until every task
    has compared, then fail with that line too, so that no task goes on into a world that is
    not whole. Each task does five round trips to the store, none reading another's view.

    Raises:
        RendezvousError: one line naming this task's view and rank 0's.
    """
    mine = view_of(env, environ)
    if env.rank == 0:
        store.set(_PREFIX + "view", json.dumps(mine))
    first = json.loads(store.get(_PREFIX + "view"))
    line = ""
    if (mine["job"], mine["step"], mine["world_size"]) != (
        first["job"],
        first["step"],
        first["world_size"],
    ):
        line = (
            f"rank {mine['rank']} on {mine['node']} ({_describe(mine)}) reached the rendezvous "
            f"store of rank 0 on {first['node']} ({_describe(first)}): a port shared with "
            "another job, or a world size set by hand; set MASTER_PORT apart, or unset WORLD_SIZE"
        )
        store.set(_PREFIX + "disagreed", line)
    if store.add(_PREFIX + "compared", 1) == int(first["world_size"]):
        store.set(_PREFIX + "done", "1")
    if line:
        raise RendezvousError(line)
    store.wait([_PREFIX + "done"])
    if store.check([_PREFIX + "disagreed"]):
        raise RendezvousError(store.get(_PREFIX + "disagreed").decode())


__all__ = [
    "RendezvousError",
    "agree_on_view",
    "check_master",
    "check_world",
    "in_slurm_step",
    "is_local",
    "resolve",
    "step_nodes",
    "view_of",
]
