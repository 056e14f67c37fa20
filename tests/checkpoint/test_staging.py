"""Async staging in one process (`checkpoint/staging.py`): one exact-size buffer, pinned as it
is (a fake of `cudaHostRegister`: no GPU here), reused by later saves; the refusal of a node
whose ranks would stage too much, which the manager turns into synchronous saves. What each
of 2 ranks stages under DDP, FSDP2 and HSDP: tests/checkpoint/test_processes.py."""

from __future__ import annotations

import logging

import pytest
import torch

from hpctrain.checkpoint import CheckpointManager
from hpctrain.checkpoint.selection import committed_steps
from hpctrain.checkpoint.staging import ReusedBufferStager, StagingTooLarge
from hpctrain.checkpoint.storage import open_store


def state() -> dict:
    return {"model": {"w": torch.arange(3.0), "b": torch.ones(100)}, "step": 7, "e": torch.ones(0)}


def test_one_exact_buffer_pinned_as_it_is_and_reused() -> None:
    pinned: list[tuple[int, int]] = []
    unpinned: list[int] = []

    def pin(ptr: int, nbytes: int):
        pinned.append((ptr, nbytes))
        return lambda: unpinned.append(ptr)

    stager = ReusedBufferStager(pin=pin, node_memory=lambda: 2**40)
    source = state()
    staged = stager.stage(source)
    # 12 and 400 bytes, each 64-byte aligned: no power-of-two rounding of the block
    assert stager.staged_bytes == 64 + 400
    assert pinned == [(stager._buffers.data_ptr(), 64 + 400)]
    assert torch.equal(staged["model"]["b"], source["model"]["b"]) and staged["step"] == 7
    assert staged["model"]["w"].data_ptr() != source["model"]["w"].data_ptr()
    source["model"]["w"] += 1  # training goes on: the staged copy stays
    assert staged["model"]["w"].tolist() == [0.0, 1.0, 2.0]
    again = stager.stage(source)
    assert again["model"]["w"].data_ptr() == staged["model"]["w"].data_ptr()  # reused
    assert again["model"]["w"].tolist() == [1.0, 2.0, 3.0] and len(pinned) == 1
    stager.close()
    assert unpinned == [pinned[0][0]]


def test_a_node_that_would_stage_more_than_half_its_memory_is_refused() -> None:
    stager = ReusedBufferStager(node_memory=lambda: 800)  # 464 bytes > half of 800
    with pytest.raises(
        StagingTooLarge,
        match=r"checkpoint.async=true: the 1 rank\(s\) on .* "
        r"would keep 0.0 GiB of checkpoint state staged in memory",
    ):
        stager.stage(state())
    assert stager._buffers is None  # refused before allocating


def test_the_manager_then_saves_synchronously_with_a_warning(
    tmp_path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr("hpctrain.checkpoint.staging.node_memory_bytes", lambda: 800)
    manager = CheckpointManager(str(tmp_path / "ck"), keep_last=2, async_save=True)
    with caplog.at_level(logging.WARNING):
        manager.save(1, state())
    assert committed_steps(open_store(str(tmp_path / "ck"))) == [1]  # committed at once
    assert "saving synchronously from now on" in caplog.text
    manager.save(2, state())
    assert committed_steps(open_store(str(tmp_path / "ck"))) == [1, 2]
    manager.close()
