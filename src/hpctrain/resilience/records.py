"""The run folder's history of attempts, read and written without torch:
`RUN_DIR/slurm/attempts.jsonl` (one `AttemptRecord` a line) and `attempts/<N>/`, what the
checkpoint root's `latest` pointer says, and how far `metrics.jsonl` got. The job script's
steps (`resilience/attempts.py`), `hpctrain status`, the goodput report and the failure rate
read them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from hpctrain.resilience.restart_policy import AttemptRecord

RECORDS = "attempts.jsonl"
FOLDERS = "attempts"
LATEST_POINTER = "latest"  # hpctrain.checkpoint.manifest's (read here without torch)


def slurm_folder(run_dir: Path) -> Path:
    return run_dir / "slurm"


def read_records(run_dir: Path) -> list[AttemptRecord]:
    """The run's attempts, oldest first; a line cut by a kill is skipped."""
    path = slurm_folder(run_dir) / RECORDS
    records = []
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            try:
                records.append(AttemptRecord.from_json(json.loads(line)))
            except (ValueError, TypeError):
                continue
    return records


def append_record(run_dir: Path, record: AttemptRecord) -> None:
    # One write of one line: the job shell is the only writer of its run folder's history.
    with open(slurm_folder(run_dir) / RECORDS, "a", encoding="utf-8") as f:
        f.write(json.dumps(record.to_json()) + "\n")


def newest_committed(root: str) -> int | None:
    """The step the checkpoint root's `latest` pointer names (None: no committed checkpoint)."""
    text = ""
    try:
        if "://" in root:
            import fsspec

            with fsspec.open(f"{root.rstrip('/')}/{LATEST_POINTER}", "rt") as f:
                text = f.read()
        else:
            text = (Path(os.path.expandvars(root)) / LATEST_POINTER).read_text()
    except (OSError, ValueError):
        return None
    text = text.strip()
    return int(text[5:]) if text.startswith("step-") and text[5:].isdigit() else None


def pointer_mark(root: str) -> str | None:
    """What tells one commit of the `latest` pointer from another, even of the same step (a
    rollback that saves step 20 again): its text, and when and as what file it was written
    (each commit replaces it by a rename). None: no pointer."""
    try:
        if "://" in root:
            import fsspec

            fs, path = fsspec.core.url_to_fs(f"{root.rstrip('/')}/{LATEST_POINTER}")
            info = fs.info(path)
            with fs.open(path, "rt") as f:
                text = f.read().strip()
            stamp = info.get("LastModified") or info.get("mtime") or info.get("ETag") or ""
            return f"{text}|{stamp}"
        path = Path(os.path.expandvars(root)) / LATEST_POINTER
        stat = path.stat()
        return f"{path.read_text().strip()}|{stat.st_mtime_ns}|{stat.st_ino}"
    except (OSError, ValueError):
        return None


def steps_logged_since(run_dir: Path, offset: int) -> int | None:
    """The highest training step metrics.jsonl got after byte `offset` (None: none)."""
    path = run_dir / "metrics.jsonl"
    step = None
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            for line in f:
                try:
                    record = json.loads(line)
                except ValueError:
                    continue  # a line cut by a kill
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    step = max(step or 0, record["step"])
    except OSError:
        return None
    return step


def file_size(path: Path) -> int:
    """Its size in bytes; 0 when it is not there."""
    try:
        return path.stat().st_size
    except OSError:
        return 0
