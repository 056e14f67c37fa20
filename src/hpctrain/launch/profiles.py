"""Cluster profiles (configs/clusters/*.yaml) and the job they give with a config's `slurm.*`.

A profile is data: partitions (with their constraint, GPUs and CPUs per node and allowed QoS),
QoS time limits, account notation, modules and precision limits. `resolve_job` merges it with
the config's `slurm.*` overrides into a `JobSpec` and checks it, so a job that a site would
reject (or run wrong) fails here, in one line, before a queue wait of hours.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from hpctrain.checkpoint.interval import DEFAULT_FAILURE_RATE, DEFAULT_NODE_MTBF_HOURS, FailureRate
from hpctrain.config import Config
from hpctrain.config.load import load_yaml
from hpctrain.errors import LaunchError  # defined there since resilience/ raises it too
from hpctrain.launch.container import container_binds
from hpctrain.resilience import failure_rate
from hpctrain.resilience.spares import SpareModel, choose_spares

PROFILES_ENV = "HPCTRAIN_CLUSTERS_DIR"
CONTAINER_RUNTIMES = ("apptainer", "singularity")
FABRICS = ("", "infiniband", "ethernet")  # distributed/fabric.py checks NCCL uses it
# A requeue's wait in the queue where neither sacct nor the profile says (slurm.spare_nodes:
# auto): a stated guess for a busy site's multi-node job, not a measurement.
DEFAULT_QUEUE_WAIT_HOURS = 1.0


@dataclass(frozen=True)
class PartitionSpec:
    """One kind of node of a cluster."""

    name: str
    partition: str  # the --partition value; empty: the site's default partition
    constraint: str  # the -C value; empty: none
    gpus_per_node: int
    cpus_per_task: int
    qos: tuple[str, ...]  # QoS allowed on it; empty: any, unchecked


@dataclass(frozen=True)
class ClusterProfile:
    """What a cluster accepts, as its documentation states it."""

    name: str
    description: str
    account_suffix: str
    hint: str
    request_gpus: bool
    default_partition: str
    partitions: dict[str, PartitionSpec]
    qos_max_minutes: dict[str, int]
    default_qos: str
    default_time: str
    precisions: tuple[str, ...]
    setup: tuple[str, ...]
    run_root: str  # where a cluster job's relative run_dir starts (launch/prepare.py)
    cache_root: str  # TORCH_HOME and HF_HOME of its jobs, unless set (launch/sbatch.py)
    gpu_arch: str = ""  # the CUDA architecture of its GPUs (sm_70, sm_80, sm_90); "": no GPU
    container_runtime: str = "apptainer"  # the command that runs slurm.container images
    # where each node keeps its copy of a compact index (hpctrain.data.node_index): /dev/shm,
    # $TMPDIR...; "": that module's default (/dev/shm)
    node_local_dir: str = ""
    source: str = ""
    # Per-job limits of a QoS where the site states them: GPUs and nodes one job may hold.
    qos_max_gpus: dict[str, int] = field(default_factory=dict)
    qos_max_nodes: dict[str, int] = field(default_factory=dict)
    fabric: str = ""  # the nodes' interconnect NCCL should use (infiniband); "": unchecked
    # the fabric's network interface on the nodes (ib0): the rendezvous store, gloo and the
    # probe use it (distributed/interfaces.py); "": found from NCCL's choice or IPoIB
    fabric_interface: str = ""
    # One node's mean time between failures, hours: the prior of checkpoint.every_minutes=auto
    # (hpctrain.resilience.failure_rate); a job on N nodes fails N times as often.
    mtbf_node_hours: float = DEFAULT_NODE_MTBF_HOURS
    # A requeue's typical wait in the queue, hours: what `slurm.spare_nodes: auto` weighs a
    # spare against when sacct knows no earlier job (hpctrain.resilience.spares).
    queue_wait_hours: float = DEFAULT_QUEUE_WAIT_HOURS
    # The newest CUDA the nodes' NVIDIA driver runs (nvidia-smi's "CUDA Version", e.g. 12.4),
    # as the site documents it; "": unknown. A torch built for a newer CUDA major cannot start.
    driver_cuda: str = ""


@dataclass(frozen=True)
class JobSpec:
    """A fully resolved SLURM job: what `sbatch` rendering and submitit both use."""

    profile: str
    job_name: str
    account: str
    partition: str
    constraint: str
    qos: str
    nodes: int
    tasks_per_node: int
    gpus_per_node: int  # GPUs requested per node (0: none, e.g. the CPU dev cluster)
    cpus_per_task: int
    hint: str
    time_minutes: int
    signal_margin_s: int
    max_requeues: int
    setup: tuple[str, ...] = field(default_factory=tuple)
    cache_root: str = ""
    gpu_arch: str = ""
    container: str = ""  # the image the trainer runs in; "": the host environment
    container_runtime: str = "apptainer"
    container_binds: tuple[str, ...] = field(default_factory=tuple)  # SRC or SRC:DEST
    max_parallel: int = 0  # a job array runs at most this many tasks at once; 0: no limit
    spare_nodes: int = 0  # asked for beyond `nodes`: standbys for a node that goes bad
    probe: bool = True  # the health probe before each attempt (resilience/probe.py)
    forkserver: bool = True  # ranks forked by a warm process per node (resilience/forkserver.py)
    fabric: str = ""  # the profile's interconnect, exported to the tasks (HPCTRAIN_FABRIC)
    fabric_interface: str = ""  # its interface (HPCTRAIN_FABRIC_INTERFACE); "": found
    driver_cuda: str = ""  # the profile's documented driver CUDA version; "": unknown
    spare_reason: str = ""  # slurm.spare_nodes=auto: why `spare_nodes` spares, in one line

    @property
    def allocated_nodes(self) -> int:
        """The job's --nodes: the nodes an attempt trains on, and the spares."""
        return self.nodes + self.spare_nodes

    @property
    def time(self) -> str:
        """The wall time as SLURM's HH:MM:SS."""
        return format_minutes(self.time_minutes)


_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_time(text: str, what: str = "slurm.time") -> int:
    """SLURM wall-time forms (M, M:S, H:M:S, D-H, D-H:M, D-H:M:S) → whole minutes (rounded up)."""
    match = _TIME.match(str(text).strip())
    if match is None:
        raise LaunchError(f"{what}={text!r}: not a SLURM time (MM, HH:MM:SS, D-HH, D-HH:MM:SS)")
    days, a, b, c = match.groups()
    if days is not None:  # D-H[:M[:S]]
        seconds = int(days) * 86400 + int(a) * 3600 + int(b or 0) * 60 + int(c or 0)
    elif c is not None:  # H:M:S
        seconds = int(a) * 3600 + int(b) * 60 + int(c)
    elif b is not None:  # M:S
        seconds = int(a) * 60 + int(b)
    else:  # M
        seconds = int(a) * 60
    if seconds <= 0:
        raise LaunchError(f"{what}={text!r}: the wall time must be positive")
    return math.ceil(seconds / 60)


def format_minutes(minutes: int) -> str:
    return f"{minutes // 60:02d}:{minutes % 60:02d}:00"


def profile_dirs() -> list[Path]:
    """Where profiles are looked up: $HPCTRAIN_CLUSTERS_DIR, ./configs/clusters, the repo's."""
    dirs = []
    if os.environ.get(PROFILES_ENV):
        dirs.append(Path(os.environ[PROFILES_ENV]))
    dirs.append(Path.cwd() / "configs" / "clusters")
    dirs.append(Path(__file__).resolve().parents[3] / "configs" / "clusters")
    return dirs


def available_profiles() -> list[str]:
    names: set[str] = set()
    for folder in profile_dirs():
        if folder.is_dir():
            names.update(p.stem for p in folder.glob("*.yaml"))
    return sorted(names)


def _need(data: dict[str, Any], key: str, tp: type, source: str) -> Any:
    if key not in data:
        raise LaunchError(f"{source}: missing key {key!r}")
    value = data[key]
    if tp is int and isinstance(value, bool):
        raise LaunchError(f"{source}: {key}={value!r} is not an integer")
    if not isinstance(value, tp):
        raise LaunchError(f"{source}: {key}={value!r} is not a {tp.__name__}")
    return value


def parse_profile(data: Any, source: str) -> ClusterProfile:
    """Check a profile's YAML data; errors name the file and key."""
    if not isinstance(data, dict):
        raise LaunchError(f"{source}: a profile is a mapping")
    known = {
        "name", "description", "account_suffix", "hint", "request_gpus", "default_partition",
        "partitions", "qos", "default_qos", "default_time", "precisions", "setup", "run_root",
        "cache_root", "gpu_arch", "container_runtime", "qos_max_gpus", "qos_max_nodes",
        "node_local_dir", "fabric", "fabric_interface", "mtbf_node_hours", "driver_cuda",
        "queue_wait_hours",
    }  # fmt: skip
    unknown = sorted(set(data) - known)
    if unknown:
        raise LaunchError(
            f"{source}: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})"
        )
    partitions: dict[str, PartitionSpec] = {}
    for name, part in _need(data, "partitions", dict, source).items():
        where = f"{source}: partitions.{name}"
        if not isinstance(part, dict):
            raise LaunchError(f"{where}: a partition is a mapping")
        partitions[str(name)] = PartitionSpec(
            name=str(name),
            partition=str(part.get("partition", "") or ""),
            constraint=str(part.get("constraint", "") or ""),
            gpus_per_node=_need(part, "gpus_per_node", int, where),
            cpus_per_task=_need(part, "cpus_per_task", int, where),
            qos=tuple(str(q) for q in part.get("qos", []) or []),
        )
    qos_max = {
        str(k): parse_time(str(v), f"{source}: qos.{k}") for k, v in (data.get("qos") or {}).items()
    }
    per_job: dict[str, dict[str, int]] = {}
    for key in ("qos_max_gpus", "qos_max_nodes"):
        limits = data.get(key) or {}
        if not isinstance(limits, dict):
            raise LaunchError(f"{source}: {key} is a mapping of QoS name to a count")
        per_job[key] = {str(q): _need(limits, q, int, f"{source}: {key}") for q in limits}
        for qos, count in per_job[key].items():
            if count < 1 or (qos_max and qos not in qos_max):
                raise LaunchError(
                    f"{source}: {key}.{qos}={count}: a QoS of `qos` and a count of at least 1"
                )
    profile = ClusterProfile(
        name=str(_need(data, "name", str, source)),
        description=str(data.get("description", "")),
        account_suffix=str(data.get("account_suffix", "") or ""),
        hint=str(data.get("hint", "") or ""),
        request_gpus=bool(data.get("request_gpus", True)),
        default_partition=str(_need(data, "default_partition", str, source)),
        partitions=partitions,
        qos_max_minutes=qos_max,
        default_qos=str(data.get("default_qos", "") or ""),
        default_time=str(_need(data, "default_time", str, source)),
        precisions=tuple(str(p) for p in _need(data, "precisions", list, source)),
        setup=tuple(str(s) for s in data.get("setup", []) or []),
        run_root=str(data.get("run_root", "") or ""),
        cache_root=str(data.get("cache_root", "") or ""),
        gpu_arch=str(data.get("gpu_arch", "") or ""),
        container_runtime=str(data.get("container_runtime", "") or "apptainer"),
        node_local_dir=_node_local_dir(data, source),
        source=source,
        qos_max_gpus=per_job["qos_max_gpus"],
        qos_max_nodes=per_job["qos_max_nodes"],
        fabric=str(data.get("fabric", "") or ""),
        fabric_interface=str(data.get("fabric_interface", "") or ""),
        mtbf_node_hours=_mtbf_node_hours(data, source),
        queue_wait_hours=_queue_wait_hours(data, source),
        driver_cuda=str(data.get("driver_cuda", "") or ""),
    )
    driver = data.get("driver_cuda", "") or ""
    # a string: YAML would read 12.10 as the number 12.1
    if driver and not (isinstance(driver, str) and re.fullmatch(r"\d+\.\d+", driver)):
        raise LaunchError(
            f'{source}: driver_cuda={driver!r} is not a quoted version like "12.4" (nvidia-smi\'s CUDA Version)'
        )
    if profile.gpu_arch and not re.fullmatch(r"sm_\d{2,3}a?", profile.gpu_arch):
        raise LaunchError(
            f"{source}: gpu_arch={profile.gpu_arch!r} is not like sm_70, sm_80, sm_90"
        )
    if profile.fabric not in FABRICS:
        raise LaunchError(
            f"{source}: fabric={profile.fabric!r} is not one of {', '.join(FABRICS[1:])} (or empty)"
        )
    if profile.fabric_interface and not re.fullmatch(
        r"[A-Za-z0-9_.:-]{1,15}", profile.fabric_interface
    ):
        raise LaunchError(
            f"{source}: fabric_interface={profile.fabric_interface!r} is not a network interface name (like ib0)"
        )
    if profile.container_runtime not in CONTAINER_RUNTIMES:
        raise LaunchError(
            f"{source}: container_runtime={profile.container_runtime!r} is not one of {', '.join(CONTAINER_RUNTIMES)}"
        )
    if profile.default_partition not in partitions:
        raise LaunchError(
            f"{source}: default_partition={profile.default_partition!r} is not one of {sorted(partitions)}"
        )
    for part in partitions.values():
        for qos in part.qos:
            if qos_max and qos not in qos_max:
                raise LaunchError(
                    f"{source}: partitions.{part.name} lists QoS {qos!r} missing from qos"
                )
    parse_time(profile.default_time, f"{source}: default_time")
    return profile


def _mtbf_node_hours(data: dict[str, Any], source: str) -> float:
    value = data.get("mtbf_node_hours", DEFAULT_NODE_MTBF_HOURS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise LaunchError(
            f"{source}: mtbf_node_hours={value!r} is not a positive number (hours between "
            "failures of one node)"
        )
    return float(value)


def _queue_wait_hours(data: dict[str, Any], source: str) -> float:
    value = data.get("queue_wait_hours", DEFAULT_QUEUE_WAIT_HOURS)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < math.inf:
        raise LaunchError(
            f"{source}: queue_wait_hours={value!r} is not a number of hours >= 0 (a requeue's "
            "wait in the queue)"
        )
    return float(value)


def load_profile(name: str) -> ClusterProfile:
    """A profile by name (configs/clusters/<name>.yaml) or by path to a YAML file."""
    path = Path(name)
    if not (name.endswith((".yaml", ".yml")) and path.is_file()):
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
            raise LaunchError(f"slurm.profile={name!r}: not a profile name or a .yaml file")
        for folder in profile_dirs():
            candidate = folder / f"{name}.yaml"
            if candidate.is_file():
                path = candidate
                break
        else:
            raise LaunchError(
                f"slurm.profile={name!r}: no such cluster profile (available: {', '.join(available_profiles())})"
            )
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LaunchError(
            f"{path}: cannot read the cluster profile: {exc.strerror or exc}"
        ) from None
    try:
        data = load_yaml(text)
    except yaml.YAMLError as exc:
        raise LaunchError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    return parse_profile(data, str(path))


def _node_local_dir(data: dict[str, Any], source: str) -> str:
    value = str(data.get("node_local_dir", "") or "")
    # rendered inside single quotes in job scripts: a path and $VARIABLES, nothing else
    if value and not re.fullmatch(r"[A-Za-z0-9_.,@+=/%~${}-]+", value):
        raise LaunchError(f"{source}: node_local_dir={value!r}: not a folder path")
    return value


def node_local_lines(profile: ClusterProfile) -> tuple[str, ...]:
    """The job's line naming the profile's node-local folder to every task (single quotes:
    each task expands `$TMPDIR` on its own node, `hpctrain.data.node_index`)."""
    if not profile.node_local_dir:
        return ()
    return (f"export HPCTRAIN_NODE_LOCAL_DIR='{profile.node_local_dir}'",)


def job_name_for(cfg: Config) -> str:
    """hpctrain-<run folder name>, with characters SLURM and shells take without quoting."""
    base = Path(cfg.run_dir.rstrip("/")).name or "run"
    return "hpctrain-" + re.sub(r"[^A-Za-z0-9_.-]", "_", base)[:64]


def account_warning(job: JobSpec, profile: ClusterProfile) -> str:
    """Why an empty `slurm.account` may be refused on `profile` ("" when it is set, or the
    site has no account notation: `account_suffix`). Printed by `sbatch` and `submit` with or
    without preflight: the queue, not this machine, would refuse the job."""
    if job.account or not profile.account_suffix:
        return ""
    return (
        f"slurm.account is empty: the job goes to your default project; with several projects, "
        f"or both CPU and GPU hours, {profile.name} needs slurm.account=<project>{profile.account_suffix}"
    )


def check_job_size(profile: ClusterProfile, qos: str, nodes: int, gpus_per_node: int) -> None:
    """Refuse a job larger than its QoS lets one job be (the profile's `qos_max_gpus`,
    `qos_max_nodes`): SLURM would queue it and never start it (`QOSMaxGRESPerJob`).

    Raises:
        LaunchError: naming the keys, the QoS's limit and the QoS that would take the job.
    """
    gpus = nodes * gpus_per_node
    for limits, count, what, keys in (
        (profile.qos_max_gpus, gpus, "GPUs", f"slurm.nodes={nodes} x {gpus_per_node} GPUs"),
        (profile.qos_max_nodes, nodes, "nodes", f"slurm.nodes={nodes}"),
    ):
        limit = limits.get(qos)
        if limit is None or count <= limit:
            continue
        others = [
            f"{q} (≤ {n} {what}, {format_minutes(profile.qos_max_minutes[q])})"
            for q, n in limits.items()
            if n >= count and q in profile.qos_max_minutes
        ]
        way = f"; slurm.qos={others[0]} takes it" if others else ""
        raise LaunchError(
            f"{keys} = {count} {what}: above the {qos} limit of {limit} {what} per job on "
            f"{profile.name}{way}"
        )


def resolve_job(
    cfg: Config, profile: ClusterProfile, *, queue_wait: tuple[float, str] | None = None
) -> JobSpec:
    """Merge the profile with `cfg.slurm` overrides and check the result against the profile.

    `queue_wait`: (hours, where from) measured for `slurm.spare_nodes: auto`
    (`resilience.spares.measured_queue_wait`); None: the profile's `queue_wait_hours`.

    Raises:
        LaunchError: one line naming the key, the value and what is allowed.
    """
    s = cfg.slurm
    part_name = s.partition or profile.default_partition
    part = profile.partitions.get(part_name)
    if part is None:
        # A raw SLURM partition name is accepted when it matches one of the profile's.
        by_sbatch_name = {p.partition: p for p in profile.partitions.values() if p.partition}
        part = by_sbatch_name.get(part_name)
    if part is None:
        raise LaunchError(
            f"slurm.partition={part_name!r}: profile {profile.name} has {', '.join(sorted(profile.partitions))}"
        )
    gpus = s.gpus_per_node or part.gpus_per_node
    if gpus > part.gpus_per_node:
        raise LaunchError(
            f"slurm.gpus_per_node={gpus}: {profile.name} partition {part.name} has {part.gpus_per_node} GPUs per node (allowed: 1-{part.gpus_per_node})"
        )
    qos = s.qos or profile.default_qos
    if qos and part.qos and qos not in part.qos:
        raise LaunchError(
            f"slurm.qos={qos!r}: {profile.name} partition {part.name} allows {', '.join(part.qos)}"
        )
    time_text = s.time or profile.default_time
    minutes = parse_time(time_text)
    if qos and qos in profile.qos_max_minutes and minutes > profile.qos_max_minutes[qos]:
        limits = ", ".join(f"{q} ≤ {format_minutes(m)}" for q, m in profile.qos_max_minutes.items())
        raise LaunchError(
            f"slurm.time={time_text!r}: above the {qos} limit of {format_minutes(profile.qos_max_minutes[qos])} on {profile.name} ({limits})"
        )
    check_job_size(profile, qos, s.nodes, gpus if profile.request_gpus else 0)
    precision = cfg.train.precision
    if precision != "auto" and precision not in profile.precisions:
        raise LaunchError(
            f"train.precision={precision!r}: not supported on {profile.name} (allowed: auto, {', '.join(profile.precisions)})"
        )
    account = s.account
    if account and profile.account_suffix and not account.endswith(profile.account_suffix):
        raise LaunchError(
            f"slurm.account={account!r}: {profile.name} accounts look like <project>{profile.account_suffix}"
        )
    if s.signal_margin_s >= minutes * 60:
        raise LaunchError(
            f"slurm.signal_margin_s={s.signal_margin_s}: must be below the wall time ({minutes * 60} s)"
        )
    spares, reason = s.spare_nodes, ""
    if spares == "auto":
        hours, where = queue_wait or (
            profile.queue_wait_hours,
            f"profile {profile.name}'s queue_wait_hours",
        )
        model = SpareModel(s.nodes, minutes / 60, profile.mtbf_node_hours, hours)
        choice = choose_spares(model, where)
        spares, reason = choice.spares, choice.line
    return JobSpec(
        profile=profile.name,
        job_name=job_name_for(cfg),
        account=account,
        partition=part.partition,
        constraint=s.constraint or part.constraint,
        qos=qos,
        nodes=s.nodes,
        tasks_per_node=gpus,
        gpus_per_node=gpus if profile.request_gpus else 0,
        cpus_per_task=s.cpus_per_task or part.cpus_per_task,
        hint=profile.hint,
        time_minutes=minutes,
        signal_margin_s=s.signal_margin_s,
        max_requeues=s.max_requeues,
        setup=node_local_lines(profile) + tuple(profile.setup) + tuple(s.setup),
        cache_root=profile.cache_root,
        gpu_arch=profile.gpu_arch,
        container=s.container,
        container_runtime=profile.container_runtime,
        container_binds=container_binds(cfg) if s.container else (),
        spare_nodes=spares,
        spare_reason=reason,
        probe=s.probe,
        forkserver=s.forkserver,
        fabric=profile.fabric,
        fabric_interface=profile.fabric_interface,
        driver_cuda=profile.driver_cuda,
    )


def run_failure_rate(cfg: Config) -> FailureRate:
    """The node failure rate for this run (the built-in default unless
    `checkpoint.every_minutes` is auto, which alone reads it): the profile's prior and the
    run's own attempts (`resilience/failure_rate.py`).

    Raises:
        LaunchError: `slurm.profile` names no readable profile.
    """
    if cfg.checkpoint.every_minutes != "auto":
        return DEFAULT_FAILURE_RATE
    profile = load_profile(cfg.slurm.profile)
    return failure_rate.run_failure_rate(
        Path(cfg.run_dir), profile.mtbf_node_hours, f"profile {profile.name}"
    )
