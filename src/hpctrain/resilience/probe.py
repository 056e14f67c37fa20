"""The health probe each node runs before an attempt: `python -m hpctrain.resilience.probe DIR ...`.

The job script runs it as one task per node of the allocation not set aside (`srun
--ntasks-per-node=1 ... python -m hpctrain.resilience.probe ATTEMPT_DIR --gpus N CONFIG
[overrides]`), before the attempt's process group is made. Each node checks, in seconds:

| check | scope | fails when |
|---|---|---|
| run folder | shared | the node cannot write, read back and remove a file in RUN_DIR/slurm |
| data | shared | a local `data.train` path is missing or unreadable from the node |
| checkpoint disk | shared | the checkpoint folder's file system has under 1 GiB free |
| local temp | node | the node's temp folder (TMPDIR) cannot take a file |
| /dev/shm | node | /dev/shm (the loader's shared memory) has under 64 MiB free |
| gpus | node | fewer GPUs are visible than the job asked for (`--gpus`; CUDA's driver API) |
| fabric | node | on an InfiniBand profile, the profile's `fabric_interface` is not on the node |
| collective | node | the node cannot reach the first node of the probe, or it none of the others |

and writes `ATTEMPT_DIR/probe-<node>.json`; a failure is also one line on stdout naming the
node and the check. `resilience/attempts.py place` reads the results: nodes that failed are set
aside when others passed; a failure every node shares on a shared path is the path's, not the
nodes' (`placement.place`).

The collective is plain TCP, not torch.distributed: importing torch alone would take longer
than every check together, and the attempt's own process group comes next with its own
timeout. The first node (the hub) listens on a free port and publishes its address in the
attempt folder (the run folder every node shares); the others connect, say who they are, and
wait for the answer that comes once all have arrived: a gather and a broadcast, timed. The hub
serves every node at once (at 2,048 nodes: `hpctrain bench probe`), and records how many
reached it; a node that cannot reach it names it. From those `placement.place` blames the
hub alone when most nodes could not reach it, and sets aside at most 1/16 of the nodes.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import errno
import json
import os
import resource
import selectors
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.distributed.env import expand_hostlist
from hpctrain.distributed.fabric import FABRIC_ENV
from hpctrain.distributed.interfaces import (
    FabricInterfaceError,
    Interface,
    fabric_interface,
    local_interfaces,
)
from hpctrain.files import write_atomic
from hpctrain.resilience.watch import node_name

MIN_SHM_FREE = 64 << 20  # the loader's pooled batches; a full /dev/shm fails its workers
MIN_CHECKPOINT_FREE = 1 << 30
RENDEZVOUS_TIMEOUT_S = 60.0  # every node's probe starts within this of the first's
ANSWER_TIMEOUT_S = 5.0  # the hub's answer: sent at once, waited for this past the gather
ADDRESS_FILE = "probe-address"
SHARED_CHECKS = frozenset({"run folder", "data", "checkpoint disk"})


def probe_file(attempt_dir: Path, node: str) -> Path:
    return attempt_dir / f"probe-{node}.json"


class CheckFailed(Exception):
    """One check's failure: the check's name and why (`blames`: the other node it names)."""

    def __init__(self, check: str, message: str, *, blames: str = "") -> None:
        super().__init__(f"{check}: {message}")
        self.check, self.message, self.blames = check, message, blames


def check_run_folder(run_dir: Path, node: str) -> None:
    path = run_dir / "slurm" / f".probe-{node}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(node.encode())
        if path.read_bytes() != node.encode():
            raise CheckFailed("run folder", f"{path} reads back other bytes")
        path.unlink()
    except OSError as exc:
        raise CheckFailed("run folder", f"{path}: {exc.strerror or exc}") from None


def check_data(cfg: Config) -> None:
    for key, value in cfg.data.train_paths():
        if "://" in value or value.startswith("pipe:") or any(c in value for c in "*?[{"):
            continue  # a URL or a pattern: the loader's preflight checks those
        path = Path(os.path.expandvars(value))
        try:
            if path.is_dir():
                os.listdir(path)
            else:
                with open(path, "rb") as f:
                    f.read(4096)
        except OSError as exc:
            raise CheckFailed("data", f"{key}={value}: {exc.strerror or exc}") from None


def _existing_parent(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def check_free(path: Path, minimum: int, check: str) -> None:
    try:
        stat = os.statvfs(_existing_parent(path))
    except OSError as exc:
        raise CheckFailed(check, f"{path}: {exc.strerror or exc}") from None
    free = stat.f_bavail * stat.f_frsize
    if free < minimum:
        raise CheckFailed(check, f"{path}: {free >> 20} MiB free, under {minimum >> 20} MiB")


def check_local_temp(node: str) -> None:
    # named by node: a temp folder shared between nodes (a container's, a test's) stays apart
    path = Path(tempfile.gettempdir()) / f"hpctrain-probe-{node}"
    try:
        path.write_bytes(b"probe")
        path.unlink()
    except OSError as exc:
        raise CheckFailed("local temp", f"{path}: {exc.strerror or exc}") from None


def visible_gpus() -> int:
    """GPUs this process can use, from CUDA's driver API (honours CUDA_VISIBLE_DEVICES).

    Through ctypes, not torch: seconds less, and a node whose driver is broken answers 0.
    """
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def check_shm() -> None:
    if Path("/dev/shm").is_dir():
        check_free(Path("/dev/shm"), MIN_SHM_FREE, "/dev/shm")


def check_checkpoint_disk(cfg: Config) -> None:
    root = cfg.checkpoint_root()
    if "://" not in root:  # an object store has no disk to fill
        check_free(Path(os.path.expandvars(root)), MIN_CHECKPOINT_FREE, "checkpoint disk")


def check_fabric(environ: Mapping[str, str], node: str) -> Interface | None:
    """On an InfiniBand profile (`HPCTRAIN_FABRIC`): this node's fabric interface, which the
    hub listens on and whose address becomes the store's (`attempts place`); None elsewhere,
    or when the node has none (no IPoIB: the default route is used)."""
    if environ.get(FABRIC_ENV, "") != "infiniband":
        return None
    try:
        choice = fabric_interface(environ, local_interfaces(), node=node)
    except FabricInterfaceError as exc:
        raise CheckFailed("fabric", str(exc)) from None
    return choice.interface if choice else None


def check_gpus(expected: int, count: Callable[[], int] = visible_gpus) -> None:
    if expected <= 0:
        return
    seen = count()
    if seen < expected:
        raise CheckFailed("gpus", f"{seen} GPU(s) visible, {expected} expected")


# ------------------------------------------------------------------------------ collective
def _raise_open_files(wanted: int) -> None:
    """Let this process hold `wanted` descriptors, up to the hard limit: many clusters' soft
    limit is 1,024, and a hub holds one socket per peer until it answers (2,048 nodes: the
    serial hub's accepts failed with EMFILE there)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))


@dataclass(frozen=True)
class Gathered:
    """What the hub saw: the seconds until it answered, and the peers that reached it."""

    seconds: float
    reached: tuple[str, ...]  # their names, in order of arrival


def serve_collective(
    attempt_dir: Path, node: str, peers: int, timeout_s: float, *, bind_address: str = ""
) -> Gathered:
    """The hub's side: publish the address, gather every peer, answer them all.

    Every peer is accepted and read at once, through one selector, on a listen backlog as deep
    as the peers: a serial accept-then-read let one peer that connected and said nothing hold
    up every other (and then failed the hub), and queued the rest behind a backlog of 128.
    `bind_address`: listen there only (the fabric's interface), and publish it; else every
    interface, published as the node's name (what the job's own rendezvous resolves).
    """
    _raise_open_files(peers + 64)
    server = socket.create_server((bind_address, 0), backlog=max(1, min(peers, 65535)))
    server.setblocking(False)
    host = bind_address or node
    write_atomic(attempt_dir / ADDRESS_FILE, f"{node} {host} {server.getsockname()[1]}\n".encode())
    started = time.monotonic()
    selector = selectors.DefaultSelector()
    selector.register(server, selectors.EVENT_READ)
    partial: dict[socket.socket, bytes] = {}  # connected, its name not read whole yet
    arrived: dict[socket.socket, str] = {}  # named, in order of arrival
    try:
        while len(arrived) < peers:
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                break
            for key, _events in selector.select(left):
                if key.fileobj is server:
                    if not _accept_queued(server, selector, partial):
                        selector.unregister(server)  # no descriptor left: serve who came
                    continue
                conn = key.fileobj
                assert isinstance(conn, socket.socket)
                name = _read_name(conn, partial)
                if name is not None:
                    selector.unregister(conn)
                    if name:
                        arrived[conn] = name
                    else:  # closed before naming itself
                        conn.close()
        for conn in arrived:
            conn.setblocking(True)
            conn.settimeout(ANSWER_TIMEOUT_S)
            with contextlib.suppress(OSError):  # a peer gone since: its own record says so
                conn.sendall(b"ok\n")
    finally:
        for conn in [*arrived, *partial]:
            conn.close()
        selector.close()
        server.close()
    if peers and not arrived:
        raise CheckFailed("collective", f"no other node reached {node} within {timeout_s:g} s")
    return Gathered(time.monotonic() - started, tuple(arrived.values()))


def _accept_queued(
    server: socket.socket, selector: selectors.BaseSelector, partial: dict[socket.socket, bytes]
) -> bool:
    """Accept every connection queued on `server`; False when out of descriptors."""
    while True:
        try:
            conn, _ = server.accept()
        except (BlockingIOError, InterruptedError):
            return True
        except OSError as exc:  # out of descriptors, or a connection reset before accepted
            return exc.errno not in (errno.EMFILE, errno.ENFILE)
        conn.setblocking(False)
        partial[conn] = b""
        selector.register(conn, selectors.EVENT_READ)


def _read_name(conn: socket.socket, partial: dict[socket.socket, bytes]) -> str | None:
    """The peer's name once its line is whole ("" if it closed first); None: not yet."""
    try:
        chunk = conn.recv(256)
    except (BlockingIOError, InterruptedError):
        return None
    except OSError:
        chunk = b""
    data = partial[conn] + chunk
    if chunk and b"\n" not in data:
        partial[conn] = data
        return None
    del partial[conn]
    return data.split(b"\n", 1)[0].decode(errors="replace").strip() if chunk else ""


def _recv_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(256)
        if not chunk:
            raise ConnectionError("closed before a full line")
        data += chunk
    return data.decode().strip()


def join_collective(attempt_dir: Path, node: str, timeout_s: float, *, hub: str = "") -> float:
    """A peer's side: find the hub's address, send our name, wait for the answer.

    `hub`: the hub's node as SLURM names it (the step's first node), to name it when it
    published no address. A failure names the hub (`CheckFailed.blames`): `place` decides
    whether the hub or this node is at fault, from every node's record.
    """
    path = attempt_dir / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise CheckFailed(
                "collective",
                f"{hub or 'the first node'} published no address within {timeout_s:g} s",
                blames=hub,
            )
        time.sleep(0.1)
    first, host, port = path.read_text().split()
    started = time.monotonic()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            conn.sendall(f"{node}\n".encode())
            # the hub answers within its own timeout_s of publishing: wait a little longer
            conn.settimeout(timeout_s + ANSWER_TIMEOUT_S)
            if _recv_line(conn) != "ok":
                raise ConnectionError("unexpected answer")
    except (OSError, ValueError) as exc:
        raise CheckFailed(
            "collective", f"cannot reach {first} ({host}:{port}): {exc}", blames=first
        ) from None
    return time.monotonic() - started


# ------------------------------------------------------------------------------ the probe
def run_probe(
    attempt_dir: Path,
    cfg: Config,
    *,
    gpus: int,
    rank: int,
    num_nodes: int,
    node: str,
    timeout_s: float = RENDEZVOUS_TIMEOUT_S,
    hub: str = "",
    environ: Mapping[str, str] | None = None,
) -> dict[str, object]:
    """Every check on this node, the collective last; the record written to the attempt folder.

    `hub`: the node of rank 0 (the step's first node), named by a peer that cannot find it.
    `environ`: the task's environment, for the fabric's interface (`check_fabric`): the hub
    listens on it, and the record holds its address (`fabric_address`).
    The record holds, besides the failure, what `place` needs to blame the right node: the
    node a collective failure names (`blames`), and for the hub how many peers reached it.
    """
    timings: dict[str, float] = {}
    failure: CheckFailed | None = None
    fabric: list[Interface] = []  # this node's fabric interface, on an InfiniBand profile

    def find_fabric() -> None:
        found = check_fabric(environ or {}, node)
        fabric.extend([found] if found else [])

    local: list[tuple[str, Callable[[], None]]] = [
        ("run folder", lambda: check_run_folder(Path(cfg.run_dir), node)),
        ("data", lambda: check_data(cfg)),
        ("local temp", lambda: check_local_temp(node)),
        ("/dev/shm", check_shm),
        ("checkpoint disk", lambda: check_checkpoint_disk(cfg)),
        ("gpus", lambda: check_gpus(gpus)),
        ("fabric", find_fabric),
    ]
    for name, check in local:
        started = time.monotonic()
        try:
            check()
        except CheckFailed as exc:
            failure = failure or exc
        timings[name] = round(time.monotonic() - started, 4)
    hub_facts: dict[str, object] = {}
    # Every node joins the collective, even one that failed a check: the others wait for it.
    if num_nodes > 1:
        try:
            if rank == 0:
                hub_facts["peers_reached"] = 0
                bind_address = fabric[0].address if fabric else ""
                gathered = serve_collective(
                    attempt_dir, node, num_nodes - 1, timeout_s, bind_address=bind_address
                )
                hub_facts["peers_reached"] = len(gathered.reached)
                timings["collective"] = round(gathered.seconds, 4)
            else:
                timings["collective"] = round(
                    join_collective(attempt_dir, node, timeout_s, hub=hub), 4
                )
        except CheckFailed as exc:
            failure = failure or exc
    record: dict[str, object] = {
        "node": node,
        "failed_check": failure.check if failure else "",
        "message": failure.message if failure else "",
        "shared": bool(failure and failure.check in SHARED_CHECKS),
        "blames": failure.blames if failure else "",
        **hub_facts,
        **(
            {"fabric_address": fabric[0].address, "fabric_interface": fabric[0].name}
            if fabric
            else {}
        ),
        "seconds": timings,
    }
    write_atomic(probe_file(attempt_dir, node), (json.dumps(record) + "\n").encode())
    if failure:
        print(f"hpctrain probe: {node} failed {failure.check}: {failure.message}", flush=True)
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.resilience.probe")
    parser.add_argument("attempt_dir")
    parser.add_argument("--gpus", type=int, default=0, help="GPUs each node must show")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    # SLURM's signals to the step (a time-limit warning, a preemption) must not look like a
    # failed node: the attempt that follows handles them.
    for sig in (signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        print(f"hpctrain probe: config error: {exc}", file=sys.stderr)
        return exc.exit_code
    step_nodes = os.environ.get("SLURM_STEP_NODELIST", "")
    run_probe(
        Path(args.attempt_dir),
        cfg,
        gpus=args.gpus,
        rank=int(os.environ.get("SLURM_PROCID", "0")),
        num_nodes=int(os.environ.get("SLURM_NTASKS", "1")),
        node=node_name(),
        hub=expand_hostlist(step_nodes)[0] if step_nodes else "",  # rank 0's, one per node
        environ=os.environ,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
