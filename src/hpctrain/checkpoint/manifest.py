"""The manifest of a committed checkpoint, its verification, and the root's names.

A committed `step-<N>/` holds DCP's files and `manifest.json`: step, world size, versions,
user metadata, the `parent` step (`selection.py`), an optional score, and per file its size,
the [offset, length, crc32c] of every DCP item in it (+ sha256).

Verification (`checkpoint.verify`): the manifest parses with the right types, every file has
its size, `.metadata` its CRC32C, and every storage path `.metadata` names is a file of this
folder; with "crc32c" (the default) each item read is checked against the CRC32C computed
while it was written, so a flipped byte found while loading also sets the checkpoint aside and
falls back. "sha256" also hashes every file on rank 0 before loading; "size" skips the
checksums (and saves without them).
"""

from __future__ import annotations

import json
import logging
import re
from typing import Any

from hpctrain.checkpoint.safety import (
    CheckpointError,
    ChecksumMismatchError,
    ItemChecksums,
    is_plain_file_name,
    load_metadata_bytes,
)
from hpctrain.checkpoint.storage import LAST_FILE, Store, crc32c_of

log = logging.getLogger(__name__)

STEP_PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-step-"
DAMAGED_PREFIX = ".damaged-step-"
ABANDONED_PREFIX = ".abandoned-step-"
LATEST_NAME = "latest"
BEST_NAME = "best"
MANIFEST_NAME = LAST_FILE
MANIFEST_FORMAT = 1
VERIFY_MODES = ("size", "crc32c", "sha256")
DEFAULT_VERIFY = "crc32c"
_STEP_DIR = re.compile(r"^step-(\d+)$")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def step_dir_name(step: int) -> str:
    return f"{STEP_PREFIX}{step}"


def committed_steps(store: Store) -> list[int]:
    """Steps with a committed `step-<N>/` folder in the store, ascending (not verified)."""
    steps = []
    for name in store.listdir():
        match = _STEP_DIR.match(name)
        if match:
            steps.append(int(match.group(1)))
    return sorted(steps)


def _is_count(value: object, minimum: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def check_file_entry(fname: object, info: object) -> str | None:
    """What is wrong with one `files` entry of a manifest, or None."""
    if not is_plain_file_name(fname):
        return f"file name {fname!r} is not a plain name"
    if not isinstance(info, dict) or not _is_count(info.get("size")):
        return f"{fname}: entry without a byte size"
    if "sha256" in info and not (isinstance(info["sha256"], str) and _SHA256.match(info["sha256"])):
        return f"{fname}: sha256 is not 64 hex digits"
    if "crc32c" in info:
        chunks = info["crc32c"]
        if not isinstance(chunks, list) or not all(
            isinstance(c, list) and len(c) == 3 and all(_is_count(v) for v in c) for c in chunks
        ):
            return f"{fname}: crc32c is not a list of [offset, length, crc]"
        end = 0
        for offset, length, _crc in sorted(chunks):  # the items cover the file, no byte unchecked
            if offset != end:
                return f"{fname}: crc32c items do not cover bytes {end}..{offset}"
            end = offset + length
        if end != info["size"]:
            return f"{fname}: crc32c items cover {end} of {info['size']} bytes"
    return None


def parse_manifest(data: bytes, where: str, name: str = "") -> dict[str, Any]:
    """The manifest of checkpoint folder `name`, or `CheckpointError` for anything malformed
    (not JSON, a missing field, a wrong type, a step other than the folder's)."""

    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{where}: unreadable manifest ({why})")

    try:
        manifest = json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad(f"not JSON: {exc}") from None
    if not isinstance(manifest, dict):
        raise bad(f"a JSON {type(manifest).__name__}, not an object")
    if manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{where}: manifest format {manifest.get('format')!r} unknown")
    for key, minimum in (("step", 0), ("world_size", 1)):
        if not _is_count(manifest.get(key), minimum):
            raise bad(f"{key} is {manifest.get(key)!r}, not an integer >= {minimum}")
    for key in ("metadata", "versions"):
        if not isinstance(manifest.get(key, {}), dict):
            raise bad(f"{key} is not an object")
    if manifest.get("parent") is not None and not _is_count(manifest["parent"], 0):
        raise bad(f"parent is {manifest['parent']!r}, not null or an integer >= 0")
    score = manifest.get("score")
    if score is not None and not (
        isinstance(score, dict)
        and isinstance(score.get("monitor"), str)
        and isinstance(score.get("value"), (int, float))
        and not isinstance(score.get("value"), bool)
    ):
        raise bad(f"score is {score!r}, not null or {{monitor: name, value: number}}")
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        raise bad("files is not an object of file entries")
    for fname, info in files.items():
        problem = check_file_entry(fname, info)
        if problem is not None:
            raise bad(problem)
    if ".metadata" not in files:
        raise CheckpointError(f"{where}: the manifest lists no DCP .metadata")
    match = _STEP_DIR.match(name)
    if match and int(match.group(1)) != manifest["step"]:
        raise bad(f"step {manifest['step']} in folder {name}")
    return manifest


def item_checksums(manifest: dict[str, Any]) -> ItemChecksums:
    """(file, offset) -> (length, crc32c) of every DCP item, for the readers."""
    return {
        (fname, offset): (length, crc)
        for fname, info in manifest["files"].items()
        if fname != ".metadata"
        for offset, length, crc in info.get("crc32c", ())
    }


def verify_checkpoint(store: Store, name: str, verify: str = DEFAULT_VERIFY) -> dict[str, Any]:
    """Check `name` against its manifest and return the manifest, or raise `CheckpointError`.

    Checks the manifest, file sizes, the CRC32C of `.metadata`, and that every storage path
    in `.metadata` is a file of this folder (see the module docstring; item checksums are
    checked while DCP reads). Raises `UnsafeCheckpointError` (not a damage to fall back
    from) when the folder is not trusted or its `.metadata` would run code or read outside.
    """
    where = store.path(name)
    store.check_trusted(["", name])
    if not store.exists(f"{name}/{MANIFEST_NAME}"):
        raise CheckpointError(f"{where}: no {MANIFEST_NAME} (not a committed hpctrain checkpoint)")
    manifest = parse_manifest(
        store.read_bytes(f"{name}/{MANIFEST_NAME}"), f"{where}/{MANIFEST_NAME}", name
    )
    files = manifest["files"]
    present = set(store.listdir(name))
    store.check_trusted([f"{name}/{f}" for f in sorted(present)])
    for fname, info in sorted(files.items()):
        if fname not in present:
            raise CheckpointError(f"{where}/{fname}: missing")
        size = store.size(f"{name}/{fname}")
        if size != info["size"]:
            raise CheckpointError(f"{where}/{fname}: {size} bytes, manifest says {info['size']}")
        if verify == "sha256" and "sha256" in info:
            digest = store.sha256(f"{name}/{fname}")
            if digest != info["sha256"]:
                raise CheckpointError(f"{where}/{fname}: sha256 differs from the manifest")
    data = store.read_bytes(f"{name}/.metadata")
    chunks = files[".metadata"].get("crc32c")
    if verify != "size" and chunks and chunks[0][2] != crc32c_of(data):
        raise ChecksumMismatchError(f"{where}/.metadata: crc32c differs from the manifest")
    # Refuse a crafted .metadata here already, before any rank hands the folder to DCP.
    metadata = load_metadata_bytes(data, f"{where}/.metadata")
    for info in metadata.storage_data.values():
        entry = files.get(info.relative_path)
        if entry is None:
            raise CheckpointError(
                f"{where}/.metadata: names {info.relative_path!r}, not a file of the manifest"
            )
        if info.offset + info.length > entry["size"]:
            raise CheckpointError(f"{where}/{info.relative_path}: shorter than .metadata says")
    return manifest


def read_latest(store: Store, pointer: str = LATEST_NAME) -> int | None:
    """The step `latest` (or the `best` pointer) names; None when missing or not `step-<N>`."""
    try:
        text = store.read_bytes(pointer).decode().strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    match = _STEP_DIR.match(text)
    if match is None:
        log.warning("%s holds %r, not step-<N>: ignored", store.path(pointer), text[:40])
        return None
    return int(match.group(1))


def check_root_trusted(store: Store) -> None:
    """Refuse a checkpoint root that a later load would refuse (`UnsafeCheckpointError`).

    Checks what loads check (the root, `latest`, every committed `step-<N>` and its files,
    the folders above the root); run at start-up, so that a run never trains for hours
    towards checkpoints it will not load. A root that does not exist yet: its parents.
    """
    if not store.exists(""):
        store.check_trusted([])
        return
    names = [""] + ([LATEST_NAME] if store.exists(LATEST_NAME) else [])
    for step in committed_steps(store):
        folder = step_dir_name(step)
        names += [folder] + [f"{folder}/{f}" for f in store.listdir(folder)]
    store.check_trusted(names)
