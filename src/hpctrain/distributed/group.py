"""Device and backend choice, process-group set-up and teardown."""

from __future__ import annotations

import datetime
import logging
import os
import shutil
import socket
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from hpctrain.distributed.env import DistEnv
from hpctrain.distributed.fabric import FABRIC_ENV, check_fabric, nccl_log_env
from hpctrain.distributed.interfaces import (
    describe_channels,
    fabric_interface,
    gloo_interface,
    local_interfaces,
    this_node,
)
from hpctrain.distributed.rendezvous import agree_on_view, check_master, check_world
from hpctrain.errors import DistributedError, LaunchFailure

log = logging.getLogger("hpctrain")


class SharedGPUError(LaunchFailure):
    """Several tasks of a node would drive one GPU (NCCL refuses: "Duplicate GPU detected")."""


def choose_device(env: DistEnv, prefer: str = "auto") -> torch.device:
    """One device per task: `cuda:<local index>` when GPUs are visible, else CPU.

    Under SLURM with `--gpus-per-task` or a gres binding each task may see only its own GPU;
    then the index is 0, otherwise the local rank. The device becomes this process's current
    CUDA device, with or without a process group: a single process with `LOCAL_RANK=1` on
    `cuda:1` would otherwise still make its CUDA context, streams and the kernels libraries
    launch without a device (triton's, flex attention's) on GPU 0.
    """
    if prefer == "cpu" or not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    index = env.local_rank if count > 1 else 0
    if index >= count:
        raise RuntimeError(f"local rank {env.local_rank} has no GPU: only {count} visible")
    device = torch.device("cuda", index)
    torch.cuda.set_device(device)
    return device


def gpu_identity(device: torch.device) -> str:
    """What tells one physical GPU from another across processes: its UUID (each task may
    number the GPUs it sees from 0)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_own_gpus(store: dist.Store, env: DistEnv, host: str, gpu: str, index: int) -> None:
    """Refuse, on every task concerned, a node where several tasks would use one GPU.

    Each task counts itself on its (host, GPU) in the rendezvous store, the last to arrive
    opens a gate, then each reads its GPU's count: all ranks in one round trip each, none
    fetching every other's key (the store is rank 0's, and jobs have thousands of ranks).
    NCCL's own refusal ("Duplicate GPU detected: rank 0 and rank 1 both on CUDA device
    ...") comes later and buried in its init's traceback.

    Raises:
        SharedGPUError: one line naming the host, the GPU and how to give each task its own.
    """
    gpus = dist.PrefixStore("hpctrain/gpus/", store)
    mine = f"{host}/{gpu}"
    gpus.add(mine, 1)
    if gpus.add("arrived", 1) == env.world_size:
        gpus.set("all", "1")
    gpus.wait(["all"])
    tasks = gpus.add(mine, 0)
    if tasks > 1:
        raise SharedGPUError(
            f"{tasks} tasks on {host} use the same GPU (cuda:{index}, {gpu}): each task needs "
            "its own: srun --gpus-per-task=1 gives each task one, or with all of a node's "
            "GPUs visible to every task, each takes its local rank's (--ntasks-per-node "
            "equal to the GPUs per node)"
        )


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


DEFAULT_TIMEOUT_S = 600.0  # train.collective_timeout_s
FLIGHT_RECORDER_ENTRIES = "2000"  # collectives each rank keeps in its ring buffer


def flight_recorder_env(environ: Mapping[str, str], hang_dir: Path) -> dict[str, str]:
    """The NCCL flight recorder's variables the user did not set: record the last
    collectives, and on a timeout dump them to `hang_dir/nccl/<job>-rank-<R>` (torch adds the
    rank). `<job>` is the same on every rank of one start and differs between starts (a
    requeued job keeps its id but not its restart count): `JOBID-RESTARTS-PORT`, or `local-PORT`.
    Read them with `torchfrtrace HANG_DIR/nccl -p <job>-rank-`."""
    job = "-".join(
        environ[name]
        for name in ("SLURM_JOB_ID", "SLURM_RESTART_COUNT", "MASTER_PORT")
        if environ.get(name)
    )
    job = job if environ.get("SLURM_JOB_ID") else f"local-{job}"
    wanted = {
        "TORCH_NCCL_TRACE_BUFFER_SIZE": FLIGHT_RECORDER_ENTRIES,
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE": str(hang_dir / "nccl" / f"{job}-rank-"),
    }
    return {name: value for name, value in wanted.items() if name not in environ}


def init_process_group(
    env: DistEnv,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    hang_dir: Path | None = None,
    *,
    require_fabric: bool = False,
) -> None:
    """Join the job's process group through `env://` (a no-op for a single process).

    `timeout_s` bounds every collective on the group: a rank that waits longer for a peer
    (hung, stopped, or dead without closing its connections) raises instead of holding the
    allocation. Groups made later need it again (`new_cpu_group`): torch gives them its own
    default (30 min for gloo), not this group's. On GPUs with `hang_dir` (RUN_DIR/hangs),
    NCCL's flight recorder is switched on unless the user set its variables
    (`flight_recorder_env`): ProcessGroupNCCL reads them when it is made, here. On a GPU job
    over several nodes of a cluster whose profile names a fabric (`HPCTRAIN_FABRIC`), NCCL's
    init log tells the network it uses: not the fabric is one warning line, or a
    `FabricError` with `require_fabric` (`slurm.require_fabric`; distributed/fabric.py).

    Before any collective, a task of a SLURM step checks that it joins the step's world
    (its size, the master address every node names) and the store's first exchange compares
    every task's view with rank 0's: a world that would split is a `RendezvousError` (exit 6,
    distributed/rendezvous.py). Over several nodes of an InfiniBand profile, gloo binds to the
    fabric's interface; the start-up log names the interface of each channel
    (distributed/interfaces.py).
    """
    check_world(env, os.environ)
    if not env.is_distributed or dist.is_initialized():
        return
    check_master(env, os.environ)
    fabric = os.environ.get(FABRIC_ENV, "")
    if env.local_world_size < env.world_size:  # over several nodes
        interfaces = local_interfaces()
        choice = (
            fabric_interface(os.environ, interfaces, node=this_node(os.environ))
            if fabric == "infiniband"
            else None
        )
        os.environ.update(gloo_interface(os.environ, choice))
        channels, warning = describe_channels(
            f"{env.master_addr}:{env.master_port}", env.master_from, os.environ, interfaces,
            choice, fabric=fabric,
        )  # fmt: skip
        if env.is_main:
            log.info(channels)
        if warning and env.local_rank == 0:  # once per node
            log.warning(warning)
    os.environ["MASTER_ADDR"] = env.master_addr
    os.environ["MASTER_PORT"] = str(env.master_port)
    os.environ["RANK"] = str(env.rank)
    os.environ["WORLD_SIZE"] = str(env.world_size)
    timeout = datetime.timedelta(seconds=timeout_s)
    # torch's own env:// rendezvous, done here so that its store serves a check before NCCL
    # starts (init_process_group(init_method="env://") does the same, then wraps the store
    # in the same PrefixStore)
    store, _rank, _size = next(dist.rendezvous("env://", env.rank, env.world_size, timeout=timeout))
    store.set_timeout(timeout)
    agree_on_view(store, env, os.environ)
    nccl_log: Path | None = None
    if device.type == "cuda":
        assert device.index is not None
        check_own_gpus(store, env, socket.gethostname(), gpu_identity(device), device.index)
        if hang_dir is not None:
            (hang_dir / "nccl").mkdir(parents=True, exist_ok=True)
            os.environ.update(flight_recorder_env(os.environ, hang_dir))
        if fabric and env.local_world_size < env.world_size:  # over several nodes
            nccl_log = Path(tempfile.mkdtemp(prefix="hpctrain-nccl-"))
            wanted = nccl_log_env(os.environ, nccl_log)
            os.environ.update(wanted)
            nccl_log = nccl_log if wanted else None
    # with device_id, NCCL makes its communicator (and picks its network) here, eagerly
    dist.init_process_group(
        backend=backend_for(device),
        store=store,
        rank=env.rank,
        world_size=env.world_size,
        timeout=timeout,
        device_id=device if device.type == "cuda" else None,
    )
    if nccl_log is not None:
        try:
            line = check_fabric(nccl_log, fabric, required=require_fabric)
        finally:
            shutil.rmtree(nccl_log, ignore_errors=True)
        if line and env.is_main:
            log.warning(line)


def destroy_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def new_cpu_group(timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.ProcessGroup:
    """A gloo group of every rank with the same collective timeout as the main group."""
    group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
    assert isinstance(group, dist.ProcessGroup)  # every rank is a member
    return group


# gloo raises a peer that went away as a plain RuntimeError with these words (torch 2.14:
# "[.../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:9866").
_GLOO_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


def peer_failure(error: BaseException) -> DistributedError | None:
    """`error` as a `DistributedError` (exit 7) when a peer rank or the network caused it,
    anywhere in its cause chain: torch's DistError family (NCCL errors, the store, the
    network; not NCCL's "invalid usage", a bug) or gloo's words for a peer gone. A checkpoint
    save that failed because a peer died is such a failure too, not the checkpoint's. None
    for anything else (and for a `DistributedError` already)."""
    seen: BaseException | None = error
    visited: set[int] = set()  # a chain can loop
    while seen is not None and id(seen) not in visited:
        visited.add(id(seen))
        if isinstance(seen, DistributedError):
            return None if seen is error else DistributedError(str(seen))
        text = str(seen)
        first = text.strip().splitlines()[0] if text.strip() else type(seen).__name__
        if isinstance(seen, dist.DistError) and "invalid usage" not in text.lower():
            return DistributedError(f"a peer rank or the network failed: {first}")
        if isinstance(seen, RuntimeError) and any(words in text for words in _GLOO_PEER_GONE):
            return DistributedError(f"a peer rank went away: {first}")
        seen = seen.__cause__ or seen.__context__
    return None


@contextmanager
def process_group(
    env: DistEnv,
    device: torch.device,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    hang_dir: Path | None = None,
    *,
    require_fabric: bool = False,
) -> Iterator[None]:
    """Init on entry, always tear down on exit (also on errors, so no rank lingers).

    On a normal exit the ranks meet in a barrier first: rank 0 hosts the rendezvous store,
    and a rank 0 that tears down and exits while another rank still talks to the store (its
    own teardown) killed that rank with SIGABRT ("terminate called without an active
    exception", about 1 run in 10 of a 2-rank `hpctrain eval` on CPU). On an error no rank
    waits for the others, which may be gone; an error a peer or the network caused leaves
    as a `DistributedError` (exit 7, retried by the job script: `peer_failure`).
    """
    init_process_group(env, device, timeout_s, hang_dir, require_fabric=require_fabric)
    try:
        yield
    except BaseException as error:
        destroy_process_group()
        failure = peer_failure(error)
        if failure is not None:
            raise failure from error
        raise
    if dist.is_initialized():
        dist.barrier()
    destroy_process_group()


def all_reduce_max(value: float, device: torch.device) -> float:
    """The max of `value` over ranks (`value` itself without a process group)."""
    if not dist.is_initialized():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def all_gather_floats(value: float, device: torch.device) -> list[float]:
    """Every rank's `value`, in rank order (`[value]` without a process group)."""
    if not dist.is_initialized():
        return [value]
    local = torch.tensor([value], dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [float(t.item()) for t in gathered]


def all_gather_vectors(values: list[float], device: torch.device) -> list[list[float]]:
    """Every rank's `values` (the same length on every rank), in rank order."""
    if not dist.is_initialized():
        return [list(values)]
    local = torch.tensor(values, dtype=torch.float64, device=device)
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    return [t.tolist() for t in gathered]


def all_hostnames() -> list[str]:
    """Every rank's host name, in rank order (one all-gather; this host alone without a group)."""
    if not dist.is_initialized():
        return [socket.gethostname()]
    names: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(names, socket.gethostname())
    return [str(name) for name in names]


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sums of `values` over ranks."""
    if not dist.is_initialized():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_reduce_tensors(sums: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Element-wise sums over ranks of tensors of any shape, in one all-reduce.

    Every rank must hold the same names and shapes (the same task on every rank does).
    """
    if not dist.is_initialized() or not sums:
        return sums
    names = sorted(sums)
    flat = torch.cat([sums[name].reshape(-1) for name in names])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    totals, offset = {}, 0
    for name in names:
        size = sums[name].numel()
        totals[name] = flat[offset : offset + size].view(sums[name].shape)
        offset += size
    return totals
