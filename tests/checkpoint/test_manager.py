"""CheckpointManager in one process: commit protocol, retention, fallback, safety, fsspec."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import stat
import uuid

import pytest
import torch

from hpctrain.checkpoint import (
    CheckpointError,
    CheckpointManager,
    ModelOptimizerState,
    PerRankState,
    RNGState,
    UnsafeCheckpointError,
    committed_steps,
    verify_checkpoint,
)
from hpctrain.checkpoint.safety import trust_problem
from hpctrain.checkpoint.storage import open_store


def make_model(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    return model, optimizer


def train_steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, n: int) -> None:
    for _ in range(n):
        loss = model(torch.randn(4, 6)).square().mean()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def states_of(model, optimizer, step: int = 0) -> dict:
    return {
        "model": ModelOptimizerState(model, optimizer),
        "rng": PerRankState(RNGState()),
        "trainer": {"step": step, "samples_seen": step * 4, "history": [1.5, 2.5]},
    }


def assert_same(a: torch.nn.Module, oa, b: torch.nn.Module, ob) -> None:
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        assert na == nb and torch.equal(pa, pb), na
    sa, sb = oa.state_dict()["state"], ob.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for key in sa:
        for name in sa[key]:
            assert torch.equal(sa[key][name], sb[key][name]), (key, name)


def test_roundtrip_is_bitwise_and_restores_rng(tmp_path):
    model, optimizer = make_model()
    train_steps(model, optimizer, 3)
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=2)
    random.seed(7)
    manager.save(3, states_of(model, optimizer, 3), metadata={"reason": "interval"})
    expected_torch, expected_py = torch.rand(3), random.random()

    fresh, fresh_opt = make_model(seed=1)
    states = states_of(fresh, fresh_opt)
    torch.manual_seed(99)
    random.seed(99)
    assert manager.load(states) == 3
    assert_same(model, optimizer, fresh, fresh_opt)
    assert states["trainer"] == {"step": 3, "samples_seen": 12, "history": [1.5, 2.5]}
    assert torch.equal(torch.rand(3), expected_torch) and random.random() == expected_py
    assert manager.loaded_manifest is not None
    assert manager.loaded_manifest["metadata"] == {"reason": "interval"}
    assert manager.loaded_manifest["versions"]["torch"] == torch.__version__
    # Training on from both gives the same weights.
    torch.manual_seed(5)
    train_steps(model, optimizer, 2)
    torch.manual_seed(5)
    train_steps(fresh, fresh_opt, 2)
    assert_same(model, optimizer, fresh, fresh_opt)
    manager.close()


def test_layout_manifest_and_latest(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=3, verify="sha256")
    manager.save(10, states_of(model, optimizer, 10))
    assert sorted(os.listdir(root)) == [".lock", "latest", "step-10"]
    assert (root / "latest").read_text() == "step-10\n"
    manifest = json.loads((root / "step-10" / "manifest.json").read_text())
    assert manifest["step"] == 10 and manifest["world_size"] == 1
    assert set(manifest["files"]) == set(os.listdir(root / "step-10")) - {"manifest.json"}
    for name, info in manifest["files"].items():
        assert info["size"] == (root / "step-10" / name).stat().st_size
        assert len(info["sha256"]) == 64
    assert manager.latest_step() == 10
    # Saving a committed step again is a no-op.
    before = (root / "step-10" / "manifest.json").read_bytes()
    manager.save(10, states_of(model, optimizer, 10))
    assert (root / "step-10" / "manifest.json").read_bytes() == before


def test_retention_keeps_last_and_milestones(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=2, keep_every=4)
    for step in range(1, 10):
        manager.save(step, states_of(model, optimizer, step))
    assert committed_steps(open_store(str(root))) == [4, 8, 9]
    assert [n for n in os.listdir(root) if n.startswith(".")] == [".lock"]
    assert (root / "latest").read_text().strip() == "step-9"


def test_damaged_latest_falls_back_and_says_why(tmp_path, caplog):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=3)
    manager.save(1, states_of(model, optimizer, 1))
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, optimizer, 1)
    manager.save(2, states_of(model, optimizer, 2))
    data_file = next(p for p in (root / "step-2").iterdir() if p.suffix == ".distcp")
    with open(data_file, "r+b") as f:
        f.truncate(data_file.stat().st_size // 2)

    fresh, fresh_opt = make_model(seed=3)
    states = states_of(fresh, fresh_opt)
    with caplog.at_level(logging.WARNING, logger="hpctrain.checkpoint"):
        assert manager.load(states) == 1
    assert "step-2 is damaged" in caplog.text and data_file.name in caplog.text
    assert "falling back" in caplog.text
    assert all(torch.equal(saved[k], v) for k, v in fresh.state_dict().items())
    assert states["trainer"]["step"] == 1

    # Set aside, so that training through step 2 again saves a good one.
    assert sorted(os.listdir(root)) == [".damaged-step-2", ".lock", "latest", "step-1"]
    assert manager.latest_step() == 1
    # The damaged one named explicitly is refused, not silently replaced.
    with pytest.raises(CheckpointError, match="manifest says"):
        manager.load(states_of(fresh, fresh_opt), which=str(root / ".damaged-step-2"))
    manager.save(2, states_of(model, optimizer, 2))
    assert manager.load(states_of(fresh, fresh_opt)) == 2
    # Everything damaged: a clear error, not a fresh start.
    (root / "step-2" / "manifest.json").unlink()
    (root / "step-1" / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="no loadable checkpoint"):
        manager.load(states_of(fresh, fresh_opt))


def test_load_none_empty_and_explicit(tmp_path):
    model, optimizer = make_model()
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=3)
    assert manager.load(states_of(model, optimizer)) is None  # nothing saved yet
    manager.save(5, states_of(model, optimizer, 5))
    manager.save(6, states_of(model, optimizer, 6))
    other = CheckpointManager(str(tmp_path / "other"), keep_last=1)
    states = states_of(model, optimizer)
    assert other.load(states, which=str(tmp_path / "ck" / "step-5")) == 5
    assert states["trainer"]["step"] == 5
    assert other.load(states, which=str(tmp_path / "ck")) == 6  # a root: its newest
    with pytest.raises(CheckpointError, match="neither a checkpoint"):
        other.load(states, which=str(tmp_path / "nowhere"))
    # A fresh start: the steps are another run's now, set aside (kept) with their pointer.
    assert manager.load(states_of(model, optimizer), which="none") is None
    assert sorted(os.listdir(tmp_path / "ck")) == [
        ".abandoned-step-5",
        ".abandoned-step-6",
        ".lock",
    ]
    assert manager.load(states_of(model, optimizer)) is None


def test_leftovers_of_killed_saves_are_ignored_and_removed(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=3)
    manager.save(1, states_of(model, optimizer, 1))
    (root / ".tmp-step-2").mkdir()
    (root / ".tmp-step-2" / "__0_0.distcp").write_bytes(b"half")
    (root / "latest.tmp-123").write_text("step-")  # the name earlier versions used
    (root / ".latest.tmp-124").write_text("step-")  # files.write_atomic's
    (root / ".best.tmp-125").write_text("step-")
    assert manager.load(states_of(model, optimizer)) == 1
    CheckpointManager(str(root), keep_last=3)  # a restart cleans up
    assert sorted(os.listdir(root)) == [".lock", "latest", "step-1"]


def test_async_save_commits_after_write_and_reuses_buffers(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    train_steps(model, optimizer, 1)
    manager = CheckpointManager(str(root), keep_last=2, async_save=True)
    manager.save(1, states_of(model, optimizer, 1))
    staged = manager._stager._buffers  # type: ignore[union-attr]
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    train_steps(model, optimizer, 1)  # training goes on while the save runs
    manager.save(2, states_of(model, optimizer, 2))  # waits for step 1 first
    assert manager._stager._buffers is staged  # type: ignore[union-attr]
    manager.wait()
    assert committed_steps(open_store(str(root))) == [1, 2]
    fresh, fresh_opt = make_model(seed=4)
    assert manager.load(states_of(fresh, fresh_opt), which=str(root / "step-1")) == 1
    assert all(torch.equal(expected[k], v) for k, v in fresh.state_dict().items())
    manager.close()


def test_fsspec_url_roundtrip(tmp_path):
    url = f"memory://ckpt-{uuid.uuid4().hex}/run"
    model, optimizer = make_model()
    train_steps(model, optimizer, 2)
    manager = CheckpointManager(url, keep_last=1, verify="sha256")
    manager.save(1, states_of(model, optimizer, 1))
    manager.save(2, states_of(model, optimizer, 2))
    store = open_store(url)
    assert committed_steps(store) == [2]
    assert store.read_bytes("latest") == b"step-2\n"
    fresh, fresh_opt = make_model(seed=2)
    assert manager.load(states_of(fresh, fresh_opt)) == 2
    assert_same(model, optimizer, fresh, fresh_opt)


class _Evil:
    """Unpickling this creates the marker file (a stand-in for arbitrary code)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _rewrite_manifest_sizes(folder) -> None:
    """What an attacker who can write the folder would do: keep the manifest consistent."""
    manifest = json.loads((folder / "manifest.json").read_text())
    for name in manifest["files"]:
        manifest["files"][name] = {"size": (folder / name).stat().st_size}
    (folder / "manifest.json").write_text(json.dumps(manifest))


def test_malicious_metadata_is_refused_without_running(tmp_path):
    root = tmp_path / "ck"
    marker = tmp_path / "pwned"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=2)
    manager.save(1, states_of(model, optimizer, 1))
    payload = pickle.dumps(_Evil(str(marker)))
    (root / "step-1" / ".metadata").write_bytes(payload)
    _rewrite_manifest_sizes(root / "step-1")

    with pytest.raises(UnsafeCheckpointError, match=r"refused to unpickle io\.open"):
        manager.load(states_of(model, optimizer))
    assert not marker.exists()
    # The payload is real: a plain unpickle would have run it.
    pickle.loads(payload)
    assert marker.exists()


def test_malicious_value_is_refused_without_running(tmp_path):
    root = tmp_path / "ck"
    marker = tmp_path / "pwned"
    manager = CheckpointManager(str(root), keep_last=2)
    manager.save(1, {"extra": {"note": _Evil(str(marker))}})
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpointError, match="not plain data"):
        manager.load({"extra": {"note": None}})
    assert not marker.exists()


def test_untrusted_folders_are_refused(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=2)
    manager.save(1, states_of(model, optimizer, 1))
    os.chmod(root / "step-1", 0o777)
    with pytest.raises(UnsafeCheckpointError, match="writable by other users"):
        manager.load(states_of(model, optimizer))
    os.chmod(root / "step-1", 0o755)
    if os.getuid() == 0:  # root can hand the file to someone else: the real case
        os.chown(root / "step-1" / ".metadata", 4242, 4242)
        with pytest.raises(UnsafeCheckpointError, match="owned by uid 4242"):
            manager.load(states_of(model, optimizer))
        os.chown(root / "step-1" / ".metadata", 0, 0)
    assert manager.load(states_of(model, optimizer)) == 1


def test_trust_problem_is_a_pure_check():
    def st(uid: int, mode: int) -> os.stat_result:
        return os.stat_result((mode, 0, 0, 1, uid, 0, 0, 0, 0, 0))

    assert trust_problem("/c", st(1000, stat.S_IFDIR | 0o755), 1000) is None
    assert trust_problem("/c", st(1000, stat.S_IFDIR | 0o775), 1000) is None
    assert "owned by uid 0" in (trust_problem("/c", st(0, stat.S_IFDIR | 0o755), 1000) or "")
    assert "writable by other" in (trust_problem("/c", st(1000, stat.S_IFDIR | 0o757), 1000) or "")


def test_verify_checkpoint_reports_missing_file(tmp_path):
    root = tmp_path / "ck"
    model, optimizer = make_model()
    CheckpointManager(str(root), keep_last=2).save(1, states_of(model, optimizer, 1))
    next(p for p in (root / "step-1").iterdir() if p.suffix == ".distcp").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(open_store(str(root)), "step-1")


def test_bad_arguments_and_unserializable_metadata(tmp_path):
    with pytest.raises(ValueError, match="keep_last"):
        CheckpointManager(str(tmp_path), keep_last=0)
    with pytest.raises(ValueError, match="verify"):
        CheckpointManager(str(tmp_path), keep_last=1, verify="md5")
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    with pytest.raises(TypeError):
        manager.save(1, {"x": {"a": 1}}, metadata={"bad": object()})


class _Stages:
    """A loader-like state whose list grows over a run (re-planned stages)."""

    def __init__(self, stages: list[dict]) -> None:
        self.stages = stages

    def state_dict(self) -> dict:
        return {"stages": self.stages, "rng": torch.arange(3)}

    def load_state_dict(self, state: dict) -> None:
        self.stages = state["stages"]
        assert torch.equal(state["rng"], torch.arange(3))


def test_per_rank_state_loads_exactly_what_was_saved_whatever_its_shape(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=1)
    saved = [{"world": 2, "consumed": 5}, {"world": 1, "consumed": 7}]
    manager.save(1, {"loader": PerRankState(_Stages(saved))})
    fresh = _Stages([{"world": 1, "consumed": 0}])  # a fresh loader has one stage
    assert manager.load({"loader": PerRankState(fresh)}) == 1
    assert fresh.stages == saved


def test_latest_step_counts_the_save_in_flight(tmp_path):
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=2, async_save=True)
    assert manager.latest_step() is None
    manager.save(3, {"x": {"w": torch.zeros(1000)}})
    assert manager.latest_step() == 3  # the same on every rank, committed or not yet
    manager.wait()
    assert manager.latest_step() == 3
    manager.close()


@pytest.mark.network
@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_s3_url_roundtrip_with_retention(async_save):
    fsspec = pytest.importorskip("fsspec")
    pytest.importorskip("s3fs")
    pytest.importorskip("moto")
    from tests.support.local_servers import moto_s3_server, s3_environment

    with moto_s3_server() as endpoint, s3_environment(endpoint):
        bucket = f"ckpt-{uuid.uuid4().hex[:12]}"  # moto's state outlives one server
        fsspec.filesystem("s3").mkdir(bucket)
        url = f"s3://{bucket}/run/checkpoints"
        model, optimizer = make_model()
        manager = CheckpointManager(url, keep_last=1, async_save=async_save, verify="sha256")
        manager.save(1, states_of(model, optimizer, 1))
        train_steps(model, optimizer, 1)
        manager.save(2, states_of(model, optimizer, 2))
        manager.wait()
        store = open_store(url)
        assert committed_steps(store) == [2]
        assert store.read_bytes("latest") == b"step-2\n"
        fresh, fresh_opt = make_model(seed=5)
        states = states_of(fresh, fresh_opt)
        assert manager.load(states) == 2
        assert_same(model, optimizer, fresh, fresh_opt)
        assert states["trainer"]["step"] == 2
        manager.close()


def test_rollback_then_preemption_resumes_the_new_branch(tmp_path):
    """--resume an older step (after a loss spike, say): later checkpoints are set aside, the
    new branch's saves are real (not skipped as existing), and an automatic resume continues
    the new branch, not the abandoned one."""
    root = tmp_path / "ck"
    model, optimizer = make_model()
    manager = CheckpointManager(str(root), keep_last=5)
    for step in (2, 4, 6):
        train_steps(model, optimizer, 2)
        manager.save(step, states_of(model, optimizer, step))

    assert manager.load(states_of(model, optimizer), which=str(root / "step-2")) == 2
    assert sorted(os.listdir(root)) == [
        ".abandoned-step-4",
        ".abandoned-step-6",
        ".lock",
        "latest",
        "step-2",
    ]
    torch.manual_seed(123)  # a different branch
    train_steps(model, optimizer, 2)
    manager.save(4, states_of(model, optimizer, 4))
    branch = {k: v.clone() for k, v in model.state_dict().items()}

    fresh, fresh_opt = make_model(seed=9)
    assert manager.load(states_of(fresh, fresh_opt)) == 4
    assert all(torch.equal(branch[k], v) for k, v in fresh.state_dict().items())


def test_latest_pointer_wins_over_a_higher_step(tmp_path):
    root = tmp_path / "ck"
    manager = CheckpointManager(str(root), keep_last=5)
    manager.save(9, {"x": {"w": torch.full((3,), 9.0)}})
    manager.save(3, {"x": {"w": torch.full((3,), 3.0)}})  # committed after step 9: `latest`
    states = {"x": {"w": torch.zeros(3)}}
    assert manager.load(states) == 3
    assert sorted(os.listdir(root)) == [".abandoned-step-9", ".lock", "latest", "step-3"]


def test_steps_to_try_follow_the_pointer_not_the_clock():
    from hpctrain.checkpoint.selection import steps_to_try

    assert steps_to_try([1, 2, 3], None) == ([3, 2, 1], [])  # no pointer: highest first
    assert steps_to_try([1, 2, 3], 3) == ([3, 2, 1], [])
    assert steps_to_try([1, 2, 3], 2) == ([2, 1], [3])  # past the pointer: never loaded
    assert steps_to_try([1, 3], 2) == ([1], [3])  # the pointer's step is gone: below it
    assert steps_to_try([5], 2) == ([], [5])
    # the step after the pointer's, saved by the same run (its parent), cut before the pointer
    parents = {3: 2, 4: 3}.get
    assert steps_to_try([1, 2, 3, 4], 2, parents) == ([3, 2, 1], [4])
    assert steps_to_try([1, 2, 4], 2, parents) == ([2, 1], [4])  # 4's parent is not 2
