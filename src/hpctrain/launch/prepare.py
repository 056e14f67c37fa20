"""Config + cluster profile → a checked job: the first step of every SLURM verb.

Where a cluster job's run folder lives is decided here, once for `sbatch`, `submit` and
`preflight`: a relative `run_dir` goes under the profile's `run_root` (Jean Zay's:
`$SCRATCH/hpctrain/runs`), not under the folder the command runs from (the clone, on `$WORK`
or `$HOME`). A local run (`hpctrain train`, `--nproc`) keeps it under the current folder.
"""

from __future__ import annotations

import dataclasses
import os
import posixpath
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import Config, load_config, with_overrides
from hpctrain.launch.profiles import (
    ClusterProfile,
    JobSpec,
    LaunchError,
    load_profile,
    resolve_job,
)

_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Prepared:
    cfg: Config
    profile: ClusterProfile
    job: JobSpec
    # the config's relative run_dir when the profile's run_root took it ("": run_dir kept)
    relative_run_dir: str = ""


def absolute_run_dir(cfg: Config) -> Config:
    """Make run_dir and slurm.folder absolute (relative to here): the job may start elsewhere."""
    overrides = [
        f"{key}={Path(value).expanduser().resolve()}"  # "~" too: the script quotes the path
        for key, value in (("run_dir", cfg.run_dir), ("slurm.folder", cfg.slurm.folder))
        if value and "$" not in value and not Path(value).is_absolute()
    ]
    return with_overrides(cfg, overrides) if overrides else cfg


def is_relative(path: str) -> bool:
    """A path that names no root of its own: not absolute, no `$VARIABLE`, `~` or URL."""
    return bool(path) and not path.startswith(("/", "$", "~")) and "://" not in path


def expand_set_variables(path: str) -> str:
    """`$VARIABLES` set here replaced by their values; unset ones left for the node."""
    return _VARIABLE.sub(
        lambda m: os.environ.get(m.group(1) or m.group(2), m.group(0)) or m.group(0), path
    )


def cluster_run_dir(cfg: Config, profile: ClusterProfile) -> Config:
    """`cfg` with the run folder a cluster job of `profile` uses.

    A relative `run_dir` goes under the profile's `run_root`, whose variables are expanded
    when set here (on a login node `$SCRATCH` is, and has the value the compute nodes see):
    the path printed is then the one to give `hpctrain status`, `eval` or `export`. Unset
    (rendering off the cluster), they are left for the job's shell. An absolute run_dir, or
    one the user wrote with a variable, is kept; a profile without a `run_root` keeps the
    old rule, the current folder. `slurm.folder` is the user's own log folder: a relative
    one stays relative to here.
    """
    if is_relative(cfg.run_dir) and profile.run_root:
        root = expand_set_variables(profile.run_root)
        cfg = with_overrides(cfg, [f"run_dir={posixpath.normpath(f'{root}/{cfg.run_dir}')}"])
    return absolute_run_dir(cfg)


def expand_on_login_node(cfg: Config, *, strict: bool) -> Config:
    """run_dir and slurm.folder with their `$VARIABLES` expanded here, for submitit.

    submitit's folder and the run's job record are written from this machine, and the job's
    #SBATCH lines cannot expand a variable: `hpctrain submit` needs literal paths. With
    `strict` (a real submission), a variable not set here is refused; without (`--dry-run`),
    it stays as written.

    Raises:
        LaunchError: with `strict`, a variable in run_dir or slurm.folder not set here.
    """
    overrides = []
    for key, value in (("run_dir", cfg.run_dir), ("slurm.folder", cfg.slurm.folder)):
        if "$" not in value:
            continue
        expanded = expand_set_variables(value)
        unset = _VARIABLE.search(expanded)
        if unset and strict:
            raise LaunchError(
                f"{key}={value}: ${unset.group(1) or unset.group(2)} is not set here, and "
                "submitit writes the run's files from this machine; submit from the cluster's "
                "login node, or give an absolute path"
            )
        overrides.append(f"{key}={expanded}")
    return with_overrides(cfg, overrides) if overrides else cfg


def for_submitit(prep: Prepared, *, strict: bool) -> Prepared:
    """`prep` with the literal paths submitit needs (`expand_on_login_node`)."""
    return dataclasses.replace(prep, cfg=expand_on_login_node(prep.cfg, strict=strict))


def slurm_folder(cfg: Config) -> Path:
    """Where job scripts and logs go: `slurm.folder`, or RUN_DIR/slurm when it is empty."""
    return Path(cfg.slurm.folder) if cfg.slurm.folder else Path(cfg.run_dir) / "slurm"


def _prepared(cfg: Config, *, place: bool = True) -> Prepared:
    prof = load_profile(cfg.slurm.profile)
    placed = cluster_run_dir(cfg, prof) if place else absolute_run_dir(cfg)
    moved = cfg.run_dir if place and is_relative(cfg.run_dir) and prof.run_root else ""
    wait = queue_wait(placed) if placed.slurm.spare_nodes == "auto" else None
    job = resolve_job(placed, prof, queue_wait=wait)
    return Prepared(cfg=placed, profile=prof, job=job, relative_run_dir=moved)


def queue_wait(cfg: Config) -> tuple[float, str] | None:
    """The queue wait sacct measured for this run (its earlier jobs, else the user's recent
    ones), for `slurm.spare_nodes: auto`; None: sacct does not answer here."""
    from hpctrain.resilience.job_records import read_job_record, recorded_job_ids
    from hpctrain.resilience.spares import measured_queue_wait

    run_dir = Path(expand_set_variables(cfg.run_dir))
    try:
        job_ids = recorded_job_ids(run_dir, read_job_record(run_dir))
    except (LaunchError, OSError):
        job_ids = []
    return measured_queue_wait(job_ids)


def prepare(config_path: str, overrides: Sequence[str], profile: str | None = None) -> Prepared:
    """Load the config with overrides (and `--profile`), its profile, and resolve the job;
    a relative run_dir goes under the profile's `run_root` (`cluster_run_dir`).

    Raises:
        ConfigError: a bad config key or value.
        LaunchError: a job the profile does not allow.
    """
    extra = [f"slurm.profile={profile}"] if profile else []
    return _prepared(load_config(config_path, [*overrides, *extra]))


def prepare_target(
    target: str, overrides: Sequence[str], profile: str | None = None
) -> tuple[Prepared, str | None]:
    """`prepare` for `submit --eval/--predict`: `target` is a config (its relative run_dir
    under the profile's `run_root`, where `submit` put the training), a run folder or a
    checkpoint (the folder as named); with the checkpoint the target names, if any.

    Raises:
        UsageError: `target` is none of these.
        ConfigError: a bad config key or value.
        LaunchError: a job the profile does not allow.
    """
    from hpctrain.inference.target import resolve_target

    extra = [f"slurm.profile={profile}"] if profile else []
    found = run_under_run_root(target, [*overrides, *extra])
    cfg, named = resolve_target(found, [*overrides, *extra])
    prep = _prepared(cfg, place="://" not in target and Path(target).is_file())
    if found != target:
        prep = dataclasses.replace(prep, relative_run_dir=target)
    return prep, named


def run_under_run_root(target: str, overrides: Sequence[str]) -> str:
    """A relative run folder or checkpoint that is not here, as found under the profile's
    `run_root` (`target` itself otherwise): where `submit CONFIG` put the training, so
    `submit runs/demo --eval` from the clone finds it. What is here wins: that is what the
    name means to every other verb."""
    if not is_relative(target) or Path(target).exists():
        return target
    names = [o.split("=", 1)[1] for o in overrides if o.startswith("slurm.profile=")]
    root = expand_set_variables(
        load_profile(names[-1] if names else Config().slurm.profile).run_root
    )
    if not root or "$" in root:  # no run_root, or its variable is not set here
        return target
    there = posixpath.join(root, target)
    return there if Path(there).exists() else target


def describe_run_dir(prep: Prepared, num_points: int = 1) -> str:
    """Where the run will live, for the line `sbatch` and `submit` print (a sweep's
    `num_points` run folders: inside it)."""
    where = f"run folder {prep.cfg.run_dir}"
    if num_points > 1:
        where = f"run folders inside {prep.cfg.run_dir}, one per sweep point"
    notes = []
    if prep.relative_run_dir:
        notes.append(
            f"run_dir={prep.relative_run_dir} under the {prep.profile.name} profile's run_root"
        )
    if "$" in prep.cfg.run_dir:
        notes.append("its variables are expanded on the node")
    elif prep.relative_run_dir:
        notes.append("give this path to hpctrain status, eval, export")
    return where + (f" ({'; '.join(notes)})" if notes else "")


def train_overrides(overrides: Sequence[str]) -> list[str]:
    """Overrides forwarded to `hpctrain train` in the job (run_dir is passed on its own)."""
    return [o for o in overrides if not o.startswith("run_dir=")]
