"""Which SLURM jobs trained into a run folder, and where their logs are.

The job id comes from RUN_DIR/slurm/job.json (written by `hpctrain submit`) or
RUN_DIR/slurm/job_id (written by the sbatch script when it starts); RUN_DIR/slurm/jobs lists
the earlier ones. `hpctrain status` and the goodput report (`goodput_report.py`) read them.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from hpctrain.errors import LaunchError

SACCT_TIMEOUT_S = 30


def read_job_record(run_dir: Path) -> dict[str, str]:
    """Job id and log paths recorded for this run folder ({} when none)."""
    slurm = run_dir / "slurm"
    record: dict[str, str] = {}
    if (slurm / "job.json").is_file():
        try:
            saved = json.loads((slurm / "job.json").read_text())
            record = {k: str(v) for k, v in saved.items()}
        except (OSError, ValueError, AttributeError) as exc:
            raise LaunchError(f"{slurm / 'job.json'}: not a job record ({exc})") from None
    if (slurm / "job_id").is_file():
        job_id = (slurm / "job_id").read_text().strip()
        # The sbatch script writes job_id when it starts; it is the newest record.
        if job_id and job_id != record.get("job_id"):
            record = {"job_id": job_id}
    if record.get("job_id") and "stdout" not in record:
        record["stdout"] = str(log_folder(run_dir) / f"{record['job_id']}.out")
    return record


def log_folder(run_dir: Path) -> Path:
    """`slurm.folder` of the run's saved config.yaml, or RUN_DIR/slurm."""
    try:
        saved = yaml.safe_load((run_dir / "config.yaml").read_text())
        folder = saved["slurm"]["folder"]
    except (OSError, yaml.YAMLError, KeyError, TypeError):
        folder = ""
    return Path(folder) if isinstance(folder, str) and folder else run_dir / "slurm"


def recorded_job_ids(run_dir: Path, record: dict[str, str]) -> list[str]:
    """Every job id recorded for the run folder, oldest first (RUN_DIR/slurm/jobs + the latest)."""
    ids: list[str] = []
    jobs_file = run_dir / "slurm" / "jobs"
    if jobs_file.is_file():
        ids = [line.strip() for line in jobs_file.read_text().splitlines() if line.strip()]
    if record.get("job_id"):
        ids.append(record["job_id"])
    return list(dict.fromkeys(ids))
