"""The checkpoint fault matrix (FAULTS.md): one test per injected fault, each small and on CPU.

Every test injects the fault the way it happens (bytes changed on disk, a crafted file, a full
file system, a skewed clock, a folder others can write) and checks what hpctrain promises:
fall back to an older checkpoint, refuse with one line naming the path, or never start.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import pickle
import shutil
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from hpctrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    CheckpointSaveError,
    UnsafeCheckpointError,
)
from hpctrain.checkpoint.storage import open_store
from hpctrain.config import Config, with_overrides


def weights(step: int) -> dict:
    """A model-like state whose every value tells the step it was saved at."""
    gen = torch.Generator().manual_seed(step)
    return {
        "app": {
            "model.layer.weight": torch.randn(64, 64, generator=gen) + step,
            "model.layer.bias": torch.full((64,), float(step)),
        },
        "trainer": {"step": step},
    }


def empty() -> dict:
    return {
        "app": {"model.layer.weight": torch.zeros(64, 64), "model.layer.bias": torch.zeros(64)},
        "trainer": {"step": -1},
    }


def save_steps(root: Path, *steps: int, **kwargs) -> CheckpointManager:
    manager = CheckpointManager(str(root), keep_last=10, **kwargs)
    for step in steps:
        manager.save(step, weights(step))
    return manager


def load_and_check(manager: CheckpointManager, expected_step: int) -> None:
    states = empty()
    assert manager.load(states) == expected_step
    assert states["trainer"]["step"] == expected_step
    assert torch.equal(states["app"]["model.layer.bias"], torch.full((64,), float(expected_step)))
    assert torch.equal(
        states["app"]["model.layer.weight"], weights(expected_step)["app"]["model.layer.weight"]
    )


def data_file(folder: Path) -> Path:
    return next(p for p in sorted(folder.iterdir()) if p.suffix == ".distcp")


def edit_manifest(folder: Path, change) -> None:  # type: ignore[no-untyped-def]
    path = folder / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


# -- content damage: a checksum computed while writing, checked while reading -----------------


@pytest.mark.parametrize(
    "damage",
    ["flip-one-byte", "zero-4KiB"],
)
def test_content_damage_of_same_size_falls_back(tmp_path, damage, caplog):
    root = tmp_path / "ck"
    manager = save_steps(root, 1, 2)
    target = data_file(root / "step-2")
    size = target.stat().st_size
    with open(target, "r+b") as f:
        if damage == "flip-one-byte":
            f.seek(size // 2)
            byte = f.read(1)
            f.seek(size // 2)
            f.write(bytes([byte[0] ^ 0x01]))
        else:
            f.seek(size // 2 - 2048)
            f.write(bytes(4096))
    assert target.stat().st_size == size  # the size check alone cannot see it
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        load_and_check(manager, 1)
    assert "crc32c" in caplog.text and target.name in caplog.text
    assert sorted(os.listdir(root)) == [".damaged-step-2", ".lock", "latest", "step-1"]


def test_content_damage_on_an_fsspec_store_falls_back():
    url = f"memory://faults-{uuid.uuid4().hex}/ck"
    manager = CheckpointManager(url, keep_last=5)
    manager.save(1, weights(1))
    manager.save(2, weights(2))
    store = open_store(url)
    name = next(n for n in store.listdir("step-2") if n.endswith(".distcp"))
    data = bytearray(store.read_bytes(f"step-2/{name}"))
    data[len(data) // 2] ^= 0x10
    store.fs.pipe_file(store.path("step-2", name), bytes(data))
    load_and_check(manager, 1)
    assert "step-2" not in store.listdir()


def test_export_checks_the_checksums_of_what_it_reads(tmp_path):
    from hpctrain.inference.export import export_weights

    root = tmp_path / "ck"
    save_steps(root, 1).close()
    result = export_weights(str(root), tmp_path / "ok.pt")
    exported = torch.load(result.out, weights_only=True)
    assert torch.equal(exported["layer.weight"], weights(1)["app"]["model.layer.weight"])
    target = data_file(root / "step-1")
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0x01
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="crc32c mismatch"):
        export_weights(str(root), tmp_path / "bad.pt")
    assert not (tmp_path / "bad.pt").exists()


# -- storage paths in .metadata stay inside the checkpoint folder -----------------------------


def _point_metadata_at(folder: Path, target: str) -> None:
    """What a crafted checkpoint does: every storage entry of `.metadata` names `target`;
    the manifest is kept consistent (an attacker writes it too)."""
    from torch.distributed.checkpoint.metadata import Metadata

    with open(folder / ".metadata", "rb") as f:
        metadata: Metadata = pickle.load(f)
    for info in metadata.storage_data.values():
        info.relative_path = target
    (folder / ".metadata").write_bytes(pickle.dumps(metadata))
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (folder / name).stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["dotdot", "absolute"])
def test_metadata_path_outside_the_folder_is_refused_by_load_and_export(tmp_path, kind):
    from hpctrain.inference.export import export_weights

    other = tmp_path / "other"
    save_steps(other, 7)  # someone else's run: the weights the crafted path points at
    root = tmp_path / "ck"
    manager = save_steps(root, 1)
    victim = data_file(other / "step-7")
    target = "../../other/step-7/" + victim.name if kind == "dotdot" else str(victim)
    _point_metadata_at(root / "step-1", target)

    with pytest.raises(UnsafeCheckpointError, match="outside"):
        export_weights(str(root), tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()
    with pytest.raises(UnsafeCheckpointError, match="outside"):
        manager.load(empty())


# -- malformed manifest: damage (fall back), never a crash ------------------------------------


MALFORMED = {
    "not-json": lambda m: "{not json",
    "a-list": lambda m: [],
    "parent-a-string": lambda m: {**m, "parent": "1"},
    "files-a-list": lambda m: {**m, "files": ["__0_0.distcp"]},
    "file-entry-a-string": lambda m: {**m, "files": dict.fromkeys(m["files"], "big")},
    "size-a-string": lambda m: {
        **m,
        "files": {k: {**v, "size": str(v["size"])} for k, v in m["files"].items()},
    },
    "step-missing": lambda m: {k: v for k, v in m.items() if k != "step"},
    "step-a-float-string": lambda m: {**m, "step": "2.5"},
    "step-of-another-folder": lambda m: {**m, "step": 5},
    "world-size-a-dict": lambda m: {**m, "world_size": {}},
    "metadata-a-list": lambda m: {**m, "metadata": [1]},
    "crc-garbage": lambda m: {
        **m,
        "files": {k: {**v, "crc32c": "zz"} for k, v in m["files"].items()},
    },
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_manifest_is_damage_and_falls_back(tmp_path, case, caplog):
    root = tmp_path / "ck"
    manager = save_steps(root, 1, 2)
    path = root / "step-2" / "manifest.json"
    changed = MALFORMED[case](json.loads(path.read_text()))
    path.write_text(changed if isinstance(changed, str) else json.dumps(changed))
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        load_and_check(manager, 1)
    assert "manifest" in caplog.text
    assert ".damaged-step-2" in os.listdir(root)


# -- choice by step number and the latest pointer, never by clocks ----------------------------


def test_clock_skew_between_nodes_does_not_pick_an_older_step(tmp_path):
    root = tmp_path / "ck"
    manager = save_steps(root, 1, 2, 3)
    # Step 3 was saved by a node whose clock runs an hour behind the one that saved step 2.
    edit_manifest(root / "step-3", lambda m: m.update(time=m["time"] - 3600))
    load_and_check(manager, 3)
    assert sorted(os.listdir(root)) == [".lock", "latest", "step-1", "step-2", "step-3"]


def test_latest_names_the_committed_newest_and_falls_back_below_it(tmp_path):
    root = tmp_path / "ck"
    manager = save_steps(root, 1, 2, 3)
    # A commit cut between its rename and `latest` (a SIGKILL at the end of a preemption
    # save): the step past the pointer whose manifest names the pointer's step as its parent
    # is the current run's, and is loaded.
    (root / "latest").write_text("step-2\n")
    load_and_check(manager, 3)
    # A step past the pointer from another run (started over with --resume none below older,
    # higher steps: its parent is not the pointer's step) is set aside, not loaded.
    (root / "latest").write_text("step-2\n")
    edit_manifest(root / "step-3", lambda m: m.update(parent=None))
    load_and_check(manager, 2)
    assert ".abandoned-step-3" in os.listdir(root)
    # A pointer naming a step that is gone: the highest verifiable step below it.
    shutil.rmtree(root / "step-2")
    load_and_check(manager, 1)


# -- folder trust: checked before a run starts, sticky parents accepted -----------------------


def test_untrusted_checkpoint_folder_stops_the_run_at_start(tmp_path):
    root = tmp_path / "ck"
    save_steps(root, 1).close()
    os.chmod(root / "step-1", 0o777)
    with pytest.raises(UnsafeCheckpointError, match="writable by other users"):
        CheckpointManager(str(root), keep_last=2)
    os.chmod(root / "step-1", 0o755)
    os.chmod(root, 0o777)
    with pytest.raises(UnsafeCheckpointError, match=f"{root} is writable by other users"):
        CheckpointManager(str(root), keep_last=2)


def test_untrusted_checkpoint_folder_fails_preflight(tmp_path):
    from hpctrain.launch.preflight import check_checkpoint_trust

    root = tmp_path / "ck"
    save_steps(root, 1).close()
    cfg = with_overrides(Config(), [f"run_dir={tmp_path / 'run'}", f"checkpoint.dir={root}"])
    assert check_checkpoint_trust(cfg).ok
    os.chmod(root / "step-1", 0o777)
    check = check_checkpoint_trust(cfg)
    assert not check.ok and "writable by other users" in check.message
    assert str(root / "step-1") in check.message


def test_folder_inside_a_sticky_world_writable_parent_is_accepted(tmp_path):
    from hpctrain.launch.preflight import check_checkpoint_trust

    shared = tmp_path / "tmp-like"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp or a tmpfs: anyone may create, only owners rename
    root = shared / "run" / "checkpoints"
    cfg = with_overrides(Config(), [f"run_dir={shared / 'run'}", f"checkpoint.dir={root}"])
    assert check_checkpoint_trust(cfg).ok  # before the folder exists
    manager = save_steps(root, 1)
    assert check_checkpoint_trust(cfg).ok
    load_and_check(manager, 1)
    # Without the sticky bit anyone could rename the run's folder and put theirs in its place.
    os.chmod(shared, 0o777)
    with pytest.raises(UnsafeCheckpointError, match="sticky"):
        CheckpointManager(str(root), keep_last=2)
    assert not check_checkpoint_trust(cfg).ok


# -- a full disk during a background save -----------------------------------------------------


@contextlib.contextmanager
def tiny_tmpfs(size: str = "1m") -> Iterator[Path]:
    """A small tmpfs (a really full file system); skipped where mounting is not allowed."""
    where = Path(tempfile.mkdtemp(prefix="hpctrain-full-"))
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(where)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        # --lazy: a failed test may leave a file open there; the mount goes once it is closed.
        subprocess.run(["umount", "--lazy", str(where)], check=True)
        where.rmdir()


@pytest.fixture
def writer_thread_errors(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BaseException]]:
    """What DCP's extra writer threads raise: they print it through `threading.excepthook`
    and return no results (the save then fails with the error). Expected in these tests, so
    it is collected here instead of reaching the output as tracebacks that read as failures
    (#43), and the test checks it is the fault it injected."""
    seen: list[BaseException] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(args.exc_value))
    yield seen


def caused_by(exc: BaseException, code: int) -> bool:
    """Whether `exc` is, or happened while handling, an OSError with errno `code`."""
    chain: BaseException | None = exc
    while chain is not None:
        if isinstance(chain, OSError) and chain.errno == code:
            return True
        chain = chain.__cause__ or chain.__context__
    return False


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_full_disk_save_error_says_no_space_and_names_the_path(async_save, writer_thread_errors):
    many = {"x": {f"t{i}": torch.randn(20_000) for i in range(40)}}  # 3.2 MB in 40 tensors
    with tiny_tmpfs() as disk:
        root = disk / "ck"
        manager = CheckpointManager(str(root), keep_last=2, async_save=async_save)
        with pytest.raises(CheckpointSaveError) as info:
            manager.save(1, many)
            manager.wait()
        message = str(info.value)
        assert "No space left on device" in message, message
        assert f"{root}/.tmp-step-1" in message and "\n" not in message
        # The partial save is gone (once no writer thread writes any more): it was what kept
        # the disk full, and the next start's lock record could not be written (flaky: it
        # depended on how far DCP's second thread had got).
        assert sorted(os.listdir(root)) == [".lock"]
        manager.close()
        # The room the partial save took is free again: the next start saves.
        manager = CheckpointManager(str(root), keep_last=2, async_save=async_save)
        manager.save(2, {"x": {"t": torch.randn(1000)}})
        manager.wait()
        assert sorted(os.listdir(root)) == [".lock", "latest", "step-2"]
        manager.close()
    assert all(caused_by(e, errno.ENOSPC) for e in writer_thread_errors), writer_thread_errors


def remount(disk: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(disk)], check=True)


@pytest.mark.parametrize("async_save", [True, False], ids=["async", "sync"])
def test_a_save_that_fills_the_disk_heals_once_space_returns(async_save, writer_thread_errors):
    """Issue 29: a requeued job must start again without anyone removing `.tmp-step-*`."""
    big = {"x": {f"t{i}": torch.randn(20_000) for i in range(40)}}  # 3.2 MB: never fits in 1 MiB
    with tiny_tmpfs("1m") as disk:
        root = disk / "ck"
        manager = CheckpointManager(str(root), keep_last=3, async_save=async_save)
        manager.save(0, weights(0))  # committed before the disk fills: never touched
        manager.wait()
        for start in ("first run", "requeued run"):
            if start != "first run":  # the start takes the lock: there is room for its record
                manager = CheckpointManager(str(root), keep_last=3, async_save=async_save)
            with pytest.raises(CheckpointSaveError) as info:
                manager.save(1, big)
                manager.wait()
            message = str(info.value)
            assert "No space left on device" in message and f"{root}/.tmp-step-1" in message
            assert "lock" not in message, (start, message)
            assert not [n for n in os.listdir(root) if n.startswith(".tmp-step-")], start
            manager.close()
        remount(disk, "32m")  # the space comes back (another job's files deleted, quota raised)
        manager = CheckpointManager(str(root), keep_last=3, async_save=async_save)
        load_and_check(manager, 0)
        manager.save(1, big)
        manager.wait()
        assert sorted(n for n in os.listdir(root) if not n.startswith(".")) == [
            "latest",
            "step-0",
            "step-1",
        ]
        restored = {"x": {name: torch.zeros(20_000) for name in big["x"]}}
        assert manager.load(restored) == 1
        assert all(torch.equal(restored["x"][n], big["x"][n]) for n in big["x"])
        manager.close()
    assert all(caused_by(e, errno.ENOSPC) for e in writer_thread_errors), writer_thread_errors


def test_a_start_whose_lock_record_finds_no_space_says_so():
    with tiny_tmpfs("1m") as disk:
        root = disk / "ck"
        root.mkdir()
        filler = disk / "users-own-file"
        with open(filler, "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        with pytest.raises(CheckpointError) as info:
            CheckpointManager(str(root), keep_last=2)
        message = str(info.value)
        assert "No space left on device" in message and f"{root}/.lock" in message, message
        assert "held by another run" not in message and "\n" not in message
        assert filler.stat().st_size > 0  # nothing of the user's is removed to make room


@pytest.mark.parametrize("verify", ["crc32c", "size"])
def test_a_failed_write_thread_never_commits_a_partial_checkpoint(
    tmp_path, monkeypatch, verify, writer_thread_errors
):
    """DCP's extra writer threads print their exception and return no results: the save must
    fail with that error, not commit a checkpoint missing that thread's tensors."""
    import torch.distributed.checkpoint.filesystem as dcp_fs

    real = dcp_fs._write_item
    failed = threading.Event()

    def write_item(*args):  # type: ignore[no-untyped-def]
        if threading.current_thread() is threading.main_thread():
            failed.wait(timeout=30)  # let the other thread take its file and fail first
            return real(*args)
        failed.set()
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(dcp_fs, "_write_item", write_item)
    root = tmp_path / "ck"
    manager = CheckpointManager(str(root), keep_last=2, verify=verify)
    with pytest.raises(CheckpointSaveError, match="Input/output error"):
        manager.save(1, {"x": {"big": torch.randn(100_000), "small": torch.randn(10)}})
    assert failed.is_set()
    assert not [n for n in os.listdir(root) if n.startswith("step-")]
    assert writer_thread_errors and all(caused_by(e, errno.EIO) for e in writer_thread_errors)
