"""CUDA out-of-memory snapshots: the wiring, on a CPU.

No GPU here, so these tests MOCK the CUDA side: the task raises `torch.OutOfMemoryError` from
its loss (what the CUDA caching allocator raises), `can_snapshot` says the device keeps
snapshots, and `torch.cuda.memory._dump_snapshot` / `_record_memory_history` are replaced by
recorders (the real ones need a CUDA device). Everything else is the real trainer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from examples.custom_task import ThumbnailMLP
from torch import nn

from hpctrain.cli.main import main
from hpctrain.errors import EXIT_CONFIG
from hpctrain.observe import memory
from hpctrain.observe.memory import StepOutOfMemoryError
from tests.train.test_trainer import build, make_config


class OutOfMemoryOnStepTwo(ThumbnailMLP):
    """ThumbnailMLP whose second loss fails as a CUDA allocation would."""

    calls = 0

    def loss(
        self, model: nn.Module, batch: dict[str, Any]
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        type(self).calls += 1
        if type(self).calls == 2:
            raise torch.OutOfMemoryError(
                "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.1 GiB"
            )
        return super().loss(model, batch)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, Any]]:
    """Mocks (no GPU here): a device that keeps snapshots, recorders for torch's calls."""
    calls: list[tuple[str, Any]] = []

    def dump_snapshot(filename: str) -> None:
        calls.append(("dump", filename))
        Path(filename).write_bytes(b"snapshot")

    def record_memory_history(**kwargs: Any) -> None:
        calls.append(("record", kwargs))

    monkeypatch.setattr(memory, "can_snapshot", lambda device: True)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump_snapshot)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", record_memory_history)
    OutOfMemoryOnStepTwo.calls = 0
    return calls


TASK = "task=tests.observe.test_memory:OutOfMemoryOnStepTwo"


def test_oom_in_a_step_writes_the_snapshot_and_names_it(
    shapes_shards: Path, tmp_path: Path, fake_cuda: list[tuple[str, Any]]
) -> None:
    run_dir = tmp_path / "run"
    trainer = build(
        make_config(shapes_shards, run_dir, TASK, "data.val=", "profile.memory_history=5000")
    )
    with pytest.raises(StepOutOfMemoryError) as caught:
        trainer.fit()
    snapshot = run_dir / "profile" / "oom-rank-0-step-2.pickle"
    assert snapshot.read_bytes() == b"snapshot"
    message = str(caught.value)
    assert str(snapshot) in message and "step 2 on rank 0" in message
    assert "Tried to allocate 2.00 GiB" in message and "data.batch_size" in message
    assert isinstance(caught.value.__cause__, torch.OutOfMemoryError)
    # History recorded from the start (before the model was built), stopped when the run ended.
    assert fake_cuda == [
        ("record", {"max_entries": 5000, "stacks": "python"}),
        ("dump", str(snapshot)),
        ("record", {"enabled": None}),
    ]


def test_without_oom_snapshot_the_error_still_says_what_to_change(
    shapes_shards: Path, tmp_path: Path, fake_cuda: list[tuple[str, Any]]
) -> None:
    run_dir = tmp_path / "run"
    trainer = build(
        make_config(shapes_shards, run_dir, TASK, "data.val=", "profile.oom_snapshot=false")
    )
    with pytest.raises(StepOutOfMemoryError, match="step 2 on rank 0: CUDA out of memory"):
        trainer.fit()
    assert fake_cuda == [] and not (run_dir / "profile").exists()


def test_the_cli_prints_one_line_and_exits_like_a_config_error(
    shapes_shards: Path, tmp_path: Path, fake_cuda: list[tuple[str, Any]], capsys: Any
) -> None:
    config = tmp_path / "oom.yaml"
    config.write_text(
        "\n".join(
            [
                f"run_dir: {tmp_path / 'run'}",
                "task: tests.observe.test_memory:OutOfMemoryOnStepTwo",
                f"data: {{train: {shapes_shards / 'train' / 'index.json'}, batch_size: 16, "
                "workers_per_rank: 0}",
                "train: {max_steps: 3, strategy: none}",
                "logging: {progress: lines}",
            ]
        )
    )
    assert main(["train", str(config)]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "out of memory: step 2 on rank 0" in err and "oom-rank-0-step-2.pickle" in err
