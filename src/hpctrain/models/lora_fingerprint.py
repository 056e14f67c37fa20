"""The fingerprint of a LoRA run's base: which weights the adapters were trained on.

A LoRA run's checkpoints hold the adapters, never the base; the base stays where
`model.init_from` names it, and the checkpoints record its fingerprint (`fingerprint`): its
path, kind and a digest of its content. A resume, `eval`, `predict`, `generate` and `export`
compare the base found at that path with it and refuse another one (`check_same_base`).

The digest covers every byte: for a Hugging Face folder or a weights file, a sha256 of each
weight file whole (and of `config.json`); for an hpctrain run, its checkpoint's manifest, which
holds a CRC32C of every item. So a tensor rewritten in the middle of a safetensors file in
place (the same size and header: another revision, a merged adapter) changes the digest.
Hashing a 70B model's 140 GB at every start would cost minutes, so each file's record keeps,
beside its sha256, what the file system says of it: size, mtime and ctime in nanoseconds and
inode number (`FileRecord`). A later fingerprint given the recorded one (`known`) re-hashes
only the files whose record differs, and reads nothing of the others: a write to a file
changes its mtime and ctime (a ctime cannot be set back: `touch -d` sets it to now), a
replaced file has another inode. A file changed within `RECENT_S` seconds of being hashed is
not trusted by its record (file systems that keep whole seconds) and hashed again next time.
The first start of a run hashes every file once, split over the ranks of the job
(`split_over_ranks`); a resume, eval or export of an unchanged base only looks at the files.

Fingerprints of checkpoints written before (no per-file records) digested each file's name,
size and first and last MiB; they are compared by that digest (`legacy_digest`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

from hpctrain.config import ConfigError
from hpctrain.models import hf, init_from

log = logging.getLogger(__name__)
SAMPLE_BYTES = 2**20  # the legacy digest's head and tail of each file
BLOCK = 16 * 2**20  # bytes read at a time when hashing
RECENT_S = 2.0  # a file modified this recently is hashed again next time (see the module)
STAT_KEYS = ("size", "mtime_ns", "ctime_ns", "inode")


def weight_files(path: str, kind: str) -> list[Path]:
    """The files whose bytes are the base: a folder's weight files and config.json, or the
    weights file itself."""
    if kind != "hf":
        return [Path(path)]
    return [*sorted(set(hf.weight_files(path).values())), Path(path) / hf.CONFIG]


def stat_record(file: Path) -> dict[str, int]:
    try:
        st = os.stat(file)
    except OSError as exc:
        raise ConfigError(f"{init_from.KEY}: cannot read {file}: {exc.strerror or exc}") from None
    return {
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def hash_file(file: Path) -> dict[str, Any]:
    """A file's record: its sha256 and what the file system said of it while it was read
    (read again when it changed meanwhile; stat fields None when it changed lately)."""
    for _ in range(3):
        before = stat_record(file)
        digest = hashlib.sha256()
        try:
            with open(file, "rb") as f:
                while block := f.read(BLOCK):
                    digest.update(block)
        except OSError as exc:
            raise ConfigError(
                f"{init_from.KEY}: cannot read {file}: {exc.strerror or exc}"
            ) from None
        if stat_record(file) == before:
            break
    else:
        raise ConfigError(f"{init_from.KEY}: {file} keeps changing while it is read")
    record: dict[str, Any] = {**before, "sha256": digest.hexdigest()}
    newest = max(before["mtime_ns"], before["ctime_ns"])
    if time.time_ns() - newest < RECENT_S * 1e9:
        record.update(dict.fromkeys(STAT_KEYS[1:]))  # never matches: hashed again next time
    return record


def reusable(known: dict[str, Any] | None, current: dict[str, int]) -> bool:
    """Whether a recorded file record still describes the file `current` (stat) describes."""
    return (
        isinstance(known, dict)
        and isinstance(known.get("sha256"), str)
        and all(known.get(key) == current[key] for key in STAT_KEYS)
    )


def split_over_ranks(files: list[Path]) -> dict[str, dict[str, Any]]:
    """The records of `files`, each hashed by one rank of the job (file i by rank i mod
    ranks) and shared with every rank; in one process, all hashed here."""
    import torch.distributed as dist

    ranks = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if ranks > 1 else 0
    mine = {str(f): hash_file(f) for i, f in enumerate(files) if i % ranks == rank}
    if ranks == 1:
        return mine
    gathered: list[Any] = [None] * ranks
    dist.all_gather_object(gathered, mine)
    records = {name: record for part in gathered for name, record in part.items()}
    for f in files:  # a rank that saw other stats than the others: its files, here
        if str(f) not in records:
            records[str(f)] = hash_file(f)
    return records


def fingerprint(
    path: str, *, ema: bool = False, known: dict[str, Any] | None = None
) -> dict[str, Any]:
    """{path, kind, ema, digest, files} of the base `path` (a `model.init_from`), see the
    module. `known`: a fingerprint recorded before, whose file records are reused for the
    files the file system says are unchanged (same path, size, mtime, ctime, inode).

    Called by every rank of a job at once (a training start), the files to hash are split
    over the ranks (a collective); otherwise in this process alone.
    """
    kind = init_from.kind_of(path)
    resolved = str(Path(path).resolve())
    if kind == "run":
        _, name, manifest, _ = init_from.open_run(path, ema=ema)
        content = json.dumps([name, ema, manifest.get("files")], sort_keys=True).encode()
        return {"path": resolved, "kind": kind, "ema": ema, "digest": sha256(content)}
    files = weight_files(path, kind)
    same_place = isinstance(known, dict) and known.get("path") == resolved
    old = (known or {}).get("files") if same_place else None
    records: dict[str, dict[str, Any]] = {}
    stale = []
    for file in files:
        entry = old.get(file.name) if isinstance(old, dict) else None
        if reusable(entry, stat_record(file)):
            assert entry is not None
            records[file.name] = dict(entry)
        else:
            stale.append(file)
    if stale:
        total = sum(f.stat().st_size for f in stale)
        log.info(
            "LoRA base: hashing %d file(s) of %s (%.1f GB) to fingerprint it%s",
            len(stale),
            path,
            total / 1e9,
            "" if old else " (once: later starts check the files' size, times and inode)",
        )
    hashed = split_over_ranks(stale)
    for file in stale:
        records[file.name] = hashed[str(file)]
    content = json.dumps(
        [[name, records[name]["size"], records[name]["sha256"]] for name in sorted(records)]
    ).encode()
    return {
        "path": resolved,
        "kind": kind,
        "ema": ema,
        "digest": sha256(content),
        "files": records,
    }


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def legacy_digest(path: str) -> str:
    """The digest checkpoints written before per-file records hold: a sha256 over each
    file's name, size and the sha256 of its first and last MiB."""
    kind = init_from.kind_of(path)
    digest = hashlib.sha256()
    for file in weight_files(path, kind):
        try:
            with open(file, "rb") as f:
                size = f.seek(0, 2)
                f.seek(0)
                head = f.read(SAMPLE_BYTES)
                f.seek(max(0, size - SAMPLE_BYTES))
                tail = f.read(SAMPLE_BYTES)
        except OSError as exc:
            raise ConfigError(
                f"{init_from.KEY}: cannot read {file}: {exc.strerror or exc}"
            ) from None
        digest.update(f"{file.name}:{size}:".encode() + hashlib.sha256(head + tail).digest())
    return digest.hexdigest()


def describe(base: dict[str, Any]) -> str:
    return f"{base.get('path')} (digest {str(base.get('digest'))[:12]})"


def changed_files(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The files whose content differs between two fingerprints of one folder, as
    `name (what)`."""
    before, now = saved.get("files") or {}, current.get("files") or {}
    changes = []
    for name in sorted(set(before) | set(now)):
        if name not in now:
            changes.append(f"{name} (gone)")
        elif name not in before:
            changes.append(f"{name} (new)")
        elif before[name].get("sha256") != now[name].get("sha256"):
            what = "size" if before[name].get("size") != now[name].get("size") else "content"
            changes.append(f"{name} (other {what})")
    return changes


def same_base(saved: dict[str, Any], current: dict[str, Any]) -> bool:
    """Whether `current` (a fresh fingerprint) is the base `saved` recorded, also for a
    fingerprint recorded before per-file records (its digest: `legacy_digest`)."""
    if saved.get("digest") == current["digest"]:
        return True
    if current["kind"] != "run" and "files" not in saved and saved.get("kind") == current["kind"]:
        return saved.get("digest") == legacy_digest(current["path"])
    return False


def check_same_base(saved: dict[str, Any] | None, current: dict[str, Any], step: Any) -> None:
    """Refuse to go on with adapters trained on another base.

    Raises:
        ConfigError: the checkpoint's base fingerprint is not `current`'s, naming both (and,
            at the same path, the files that changed).
    """
    if saved is None or same_base(saved, current):
        return
    key = f"model.init_from={current['path']}"
    if saved.get("path") == current["path"]:
        changes = changed_files(saved, current)
        what = f": {', '.join(changes[:4])}" if changes else ""
        raise ConfigError(
            f"{key}: the base changed since the checkpoint of step {step} was trained on it"
            f"{what} (digest then {str(saved.get('digest'))[:12]}, now "
            f"{current['digest'][:12]}); the adapters fit their own base only: put that "
            "base's files back at this path, or start over in a new run folder"
        )
    raise ConfigError(
        f"{key}: not the base the checkpoint of step {step} was trained on (its base: "
        f"{describe(saved)}; now: {describe(current)}); the adapters fit their own base only: "
        "set model.init_from back to it, or start over in a new run folder"
    )
