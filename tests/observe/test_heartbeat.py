"""A rank's heartbeat (`observe/heartbeat.py`): the record its watcher reads, and the
allowances learnt from the run. The watcher acting on it: tests/resilience/test_watch.py."""

from __future__ import annotations

from pathlib import Path

from hpctrain.observe.heartbeat import Progress, read_beat


def test_the_allowance_is_learnt_from_the_slowest_recent_step(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    progress = Progress(path, floor_s=30, factor=5, first_s=1800, prior_save_s=20)
    progress.starting()
    beat = read_beat(path)
    assert beat is not None and (beat.phase, beat.allowance_s) == ("startup", 1800)
    with progress.step(1):  # the first step of the process: compiles, its own allowance
        beat = read_beat(path)
        assert beat is not None and (beat.phase, beat.allowance_s) == ("first step", 1800)
    assert progress.step_allowance() == 30  # max(floor, 5 x the first step) until measured
    progress.steps.extend([2.0, 9.0, 4.0])
    assert progress.step_allowance() == 45  # 5 x the slowest recent step
    assert progress.save_allowance() == 100  # 5 x the run's last recorded save
    assert progress.eval_allowance() == 1800  # no evaluation measured yet: as a first step
    with progress.phase("eval"):
        beat = read_beat(path)
        assert beat is not None and (beat.phase, beat.allowance_s) == ("eval", 1800)
    after = read_beat(path)
    assert after is not None and (after.phase, after.allowance_s) == ("step", 45)
    assert after.beats == beat.beats + 1
    progress.first_step_s = 12.0  # the first step, which started the loader, took 12 s
    with progress.step(5):  # an epoch starts inside it: its workers may start again
        progress.loading()
        assert read_beat(path).allowance_s == 60  # type: ignore[union-attr]  # 5 x 12 s
    # not the first step's 30 minutes: a rank stopped at an epoch's start is found as soon
    fresh = Progress(path, floor_s=30, factor=5, first_s=1800)
    with fresh.step(1):  # the first epoch starts inside the process's first step
        fresh.loading()
        assert read_beat(path).allowance_s == 1800  # type: ignore[union-attr]
    progress.ending()
    assert read_beat(path).allowance_s == 0  # type: ignore[union-attr]
    off = Progress(path, floor_s=0)
    assert off.step_allowance() == off.save_allowance() == 0
    assert Progress(None).active is False  # no watcher: nothing written
    assert Progress(path, save_s=200).save_allowance() == 200


def test_a_record_being_written_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "beat"
    Progress(path).starting()
    data = bytearray(path.read_bytes())
    data[-8:] = (12345).to_bytes(8, "little")  # the writer between its two sequence numbers
    path.write_bytes(bytes(data))
    assert read_beat(path) is None
    assert read_beat(tmp_path / "none") is None
