"""Config + cluster profile → a checked job: the first step of every SLURM verb."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from hpctrain.config import Config, load_config, with_overrides
from hpctrain.launch.profiles import ClusterProfile, JobSpec, load_profile, resolve_job


@dataclass(frozen=True)
class Prepared:
    cfg: Config
    profile: ClusterProfile
    job: JobSpec


def absolute_run_dir(cfg: Config) -> Config:
    """Make run_dir and slurm.folder absolute (relative to here): the job may start elsewhere."""
    overrides = [
        f"{key}={Path(value).resolve()}"
        for key, value in (("run_dir", cfg.run_dir), ("slurm.folder", cfg.slurm.folder))
        if value and "$" not in value and not Path(value).is_absolute()
    ]
    return with_overrides(cfg, overrides) if overrides else cfg


def slurm_folder(cfg: Config) -> Path:
    """Where job scripts and logs go: `slurm.folder`, or RUN_DIR/slurm when it is empty."""
    return Path(cfg.slurm.folder) if cfg.slurm.folder else Path(cfg.run_dir) / "slurm"


def prepare(config_path: str, overrides: Sequence[str], profile: str | None = None) -> Prepared:
    """Load the config with overrides (and `--profile`), its profile, and resolve the job.

    Raises:
        ConfigError: a bad config key or value.
        LaunchError: a job the profile does not allow.
    """
    extra = [f"slurm.profile={profile}"] if profile else []
    cfg = absolute_run_dir(load_config(config_path, [*overrides, *extra]))
    prof = load_profile(cfg.slurm.profile)
    return Prepared(cfg=cfg, profile=prof, job=resolve_job(cfg, prof))


def train_overrides(overrides: Sequence[str]) -> list[str]:
    """Overrides forwarded to `hpctrain train` in the job (run_dir is passed on its own)."""
    return [o for o in overrides if not o.startswith("run_dir=")]
