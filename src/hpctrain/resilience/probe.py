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
| collective | node | the node cannot reach the first node of the probe, or it none of the others |

and writes `ATTEMPT_DIR/probe-<node>.json`; a failure is also one line on stdout naming the
node and the check. `resilience/attempts.py place` reads the results: nodes that failed are set
aside when others passed; a failure every node shares on a shared path is the path's, not the
nodes' (`restart_policy.place`).

The collective is plain TCP, not torch.distributed: importing torch alone would take longer
than every check together, and the attempt's own process group comes next with its own
timeout. The first node listens on a free port and publishes `host:port` in the attempt folder
(the run folder every node shares); the others connect, say who they are, and wait for the
answer that comes once all have arrived: a gather and a broadcast, timed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.files import write_atomic
from hpctrain.resilience.watch import node_name

MIN_SHM_FREE = 64 << 20  # the loader's pooled batches; a full /dev/shm fails its workers
MIN_CHECKPOINT_FREE = 1 << 30
RENDEZVOUS_TIMEOUT_S = 60.0  # every node's probe starts within this of the first's
ADDRESS_FILE = "probe-address"
SHARED_CHECKS = frozenset({"run folder", "data", "checkpoint disk"})


def probe_file(attempt_dir: Path, node: str) -> Path:
    return attempt_dir / f"probe-{node}.json"


class CheckFailed(Exception):
    """One check's failure: the check's name and why."""

    def __init__(self, check: str, message: str) -> None:
        super().__init__(f"{check}: {message}")
        self.check, self.message = check, message


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


def check_gpus(expected: int, count: Callable[[], int] = visible_gpus) -> None:
    if expected <= 0:
        return
    seen = count()
    if seen < expected:
        raise CheckFailed("gpus", f"{seen} GPU(s) visible, {expected} expected")


# ------------------------------------------------------------------------------ collective
def _recv_line(conn: socket.socket) -> str:
    data = b""
    while not data.endswith(b"\n"):
        chunk = conn.recv(256)
        if not chunk:
            raise ConnectionError("closed before a full line")
        data += chunk
    return data.decode().strip()


def serve_collective(attempt_dir: Path, node: str, peers: int, timeout_s: float) -> float:
    """The first node's side: publish the address, gather every peer, answer them all."""
    server = socket.create_server(("", 0))
    server.settimeout(timeout_s)
    host = socket.gethostname()
    write_atomic(attempt_dir / ADDRESS_FILE, f"{node} {host} {server.getsockname()[1]}\n".encode())
    started = time.monotonic()
    conns: list[socket.socket] = []
    try:
        while len(conns) < peers:
            left = timeout_s - (time.monotonic() - started)
            if left <= 0:
                break
            server.settimeout(left)
            try:
                conn, _ = server.accept()
            except TimeoutError:
                break
            conn.settimeout(timeout_s)
            _recv_line(conn)
            conns.append(conn)
        for conn in conns:
            conn.sendall(b"ok\n")
    finally:
        for conn in conns:
            conn.close()
        server.close()
    if peers and not conns:
        raise CheckFailed("collective", f"no other node reached {node} within {timeout_s:g} s")
    return time.monotonic() - started


def join_collective(attempt_dir: Path, node: str, timeout_s: float) -> float:
    """Another node's side: find the first node's address, send our name, wait for the answer."""
    path = attempt_dir / ADDRESS_FILE
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise CheckFailed(
                "collective", f"the first node published no address within {timeout_s:g} s"
            )
        time.sleep(0.1)
    first, host, port = path.read_text().split()
    started = time.monotonic()
    try:
        with socket.create_connection((first, int(port)), timeout=timeout_s) as conn:
            conn.sendall(f"{node}\n".encode())
            if _recv_line(conn) != "ok":
                raise ConnectionError("unexpected answer")
    except (OSError, ValueError) as exc:
        raise CheckFailed("collective", f"cannot reach {first} ({host}:{port}): {exc}") from None
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
) -> dict[str, object]:
    """Every check on this node, the collective last; the record written to the attempt folder."""
    timings: dict[str, float] = {}
    failure: CheckFailed | None = None
    local: list[tuple[str, Callable[[], None]]] = [
        ("run folder", lambda: check_run_folder(Path(cfg.run_dir), node)),
        ("data", lambda: check_data(cfg)),
        ("local temp", lambda: check_local_temp(node)),
        ("/dev/shm", check_shm),
        ("checkpoint disk", lambda: check_checkpoint_disk(cfg)),
        ("gpus", lambda: check_gpus(gpus)),
    ]
    for name, check in local:
        started = time.monotonic()
        try:
            check()
        except CheckFailed as exc:
            failure = failure or exc
        timings[name] = round(time.monotonic() - started, 4)
    # Every node joins the collective, even one that failed a check: the others wait for it.
    if num_nodes > 1:
        try:
            if rank == 0:
                took = serve_collective(attempt_dir, node, num_nodes - 1, timeout_s)
            else:
                took = join_collective(attempt_dir, node, timeout_s)
            timings["collective"] = round(took, 4)
        except CheckFailed as exc:
            failure = failure or exc
    record: dict[str, object] = {
        "node": node,
        "failed_check": failure.check if failure else "",
        "message": failure.message if failure else "",
        "shared": bool(failure and failure.check in SHARED_CHECKS),
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
    run_probe(
        Path(args.attempt_dir),
        cfg,
        gpus=args.gpus,
        rank=int(os.environ.get("SLURM_PROCID", "0")),
        num_nodes=int(os.environ.get("SLURM_NTASKS", "1")),
        node=node_name(),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
