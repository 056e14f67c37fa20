"""`tools/gpu_bench.sh`'s GPU-only checks (`bench/gpu_checks.py`) without a GPU: what each
expects (its `judge_*`), and the signals check run for real on a 2-process CPU run (fork-started
loader workers here, a forkserver's on a GPU: the machinery of starting, signalling the whole
process group and judging is the same). The dry run is in test_gpu_vision.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hpctrain.bench import gpu_checks
from hpctrain.bench.gpu_checks import Run


def write_losses(run_dir: Path, losses: list[float]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text(
        "".join(json.dumps({"kind": "train", "loss": loss}) + "\n" for loss in losses)
    )


def test_deterministic_must_be_refused_or_warned_on_cuda(tmp_path: Path) -> None:
    refusal = "hpctrain train: config error: train.deterministic=true on cuda: ..."
    assert gpu_checks.judge_deterministic(Run(2, refusal, tmp_path), "cuda").startswith(
        "ok (refused: hpctrain train: config error: train.deterministic=true"
    )
    crash = "RuntimeError: adaptive_avg_pool2d_backward_cuda does not have a deterministic..."
    assert gpu_checks.judge_deterministic(Run(1, crash, tmp_path), "cuda").startswith("FAILED")
    write_losses(tmp_path, [2.3])
    warned = "WARNING train.deterministic=true: warn_only, some CUDA ops are not deterministic"
    assert gpu_checks.judge_deterministic(Run(0, warned, tmp_path), "cuda").startswith(
        "ok (warned and trained"
    )
    silent = gpu_checks.judge_deterministic(Run(0, "", tmp_path), "cuda")
    assert silent == "FAILED: trained on CUDA without a word about train.deterministic"
    assert gpu_checks.judge_deterministic(Run(0, "", tmp_path), "cpu").startswith("ok (trained")


def test_flex_must_train_with_finite_losses(tmp_path: Path) -> None:
    assert gpu_checks.judge_flex(Run(0, "", tmp_path)).startswith("FAILED: losses []")
    write_losses(tmp_path, [5.5, float("nan")])
    assert gpu_checks.judge_flex(Run(0, "", tmp_path)).startswith("FAILED: losses")
    write_losses(tmp_path, [5.5, 5.4])
    assert gpu_checks.judge_flex(Run(0, "", tmp_path)).startswith(
        "ok (2 steps, per-document attention"
    )
    fallback = "INFO per-document attention: no C compiler for flex attention; SDPA masked path"
    assert "fell back: INFO per-document attention" in gpu_checks.judge_flex(
        Run(0, fallback, tmp_path)
    )
    assert gpu_checks.judge_flex(Run(1, "triton error", tmp_path)).startswith("FAILED: exit 1")


def test_signals_must_leave_the_workers_alive_and_save(tmp_path: Path) -> None:
    seen = {"before": 2, "after_usr1": 5}
    died = "hpctrain train: data error: loader worker 0 (pid 12) exited unexpectedly (SIGKILL)"
    assert gpu_checks.judge_signals(75, died, tmp_path, seen, 2).startswith(
        "FAILED: a loader worker died"
    )
    assert gpu_checks.judge_signals(75, "", tmp_path, seen, 2).startswith("FAILED: exit 75")
    (tmp_path / "checkpoints" / "step-6").mkdir(parents=True)
    assert gpu_checks.judge_signals(75, "", tmp_path, seen, 2) == (
        "ok (2 process(es): 2 steps, USR1, 5 steps, USR2 -> saved step-6, exit 75)"
    )
    assert gpu_checks.judge_signals(1, "", tmp_path, seen, 2).startswith("FAILED: exit 1")
    stopped = gpu_checks.judge_signals(-1, "", tmp_path, {"before": 2, "timeout": 1}, 2)
    assert stopped.startswith("FAILED: 2 process(es) did not train on after USR1")


@pytest.mark.slow
@pytest.mark.distributed
def test_the_signals_check_runs_on_a_live_two_process_run(
    shapes_shards: Path, tmp_path: Path
) -> None:
    line = gpu_checks.check_signals(tmp_path, shapes_shards / "train", "cpu", num_gpus=0)
    assert line.startswith("ok (2 process(es): "), line
    assert line.endswith(", exit 75)"), line
