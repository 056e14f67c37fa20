"""`hpctrain bench trainer` machinery, on the tiny MLP only (the real run is in BENCHMARKS.md)."""

from __future__ import annotations

from pathlib import Path

from hpctrain.bench import trainer


def test_trainer_bench_pairs_and_report(tmp_path: Path) -> None:
    result = trainer.compare("mlp", pairs=3, steps=5, work=tmp_path)
    assert result["pairs"] == 3
    for clock in ("cpu", "wall"):
        r = result[clock]
        assert r["reference_step_ms"] > 0
        assert r["ratio_min"] <= r["ratio"] <= r["ratio_max"]
        assert r["aa_min"] <= r["aa_ratio"] <= r["aa_max"]
    text = trainer.format_results({"compare": [result]})
    lines = text.splitlines()
    assert len(lines) == 4  # per clock: the ratios, then the step times
    assert lines[0].startswith("mlp cpu time: Trainer / reference loop = ")
    assert "reference B / reference A" in lines[0]
    assert lines[1].startswith("mlp cpu time per step: reference loop ")
    assert " ms, Trainer " in lines[1] and "Trainer - reference loop = " in lines[1]


def test_gpt_reference_loss_is_the_causal_lm_loss(tmp_path: Path) -> None:
    """The hand-written loop computes what the `causal_lm` task computes, so the benchmark
    compares the cost of the same work."""
    import torch

    from hpctrain.data import open_index
    from hpctrain.tasks.task import load_task

    cfg = trainer.bench_config("gpt-tiny", tmp_path, seq_len=16)
    task = load_task(cfg, open_index(cfg.data.train))
    model = task.build_model()
    batch = trainer.make_batches("gpt-tiny", 1, batch_size=2, seq_len=16)[0]
    assert batch["tokens"].shape == (2, 17)
    reference, _ = trainer.next_token_loss(model, batch)
    loss, _ = task.loss(model, batch)
    torch.testing.assert_close(reference, loss)


def test_the_document_mask_case_gives_the_trainer_documents(tmp_path: Path) -> None:
    """`gpt-tiny+docs`: the Trainer's batches carry document positions (its loss attends per
    document), the reference loop's plain causal loss ignores them."""
    import torch

    from hpctrain.data import open_index
    from hpctrain.tasks.task import load_task

    cfg = trainer.bench_config(trainer.GPT_DOCS, tmp_path, seq_len=64)
    task = load_task(cfg, open_index(cfg.data.train))
    model = task.build_model()
    batch = trainer.make_batches(trainer.GPT_DOCS, 1, batch_size=2, seq_len=64)[0]
    positions = batch["positions"]
    assert positions.shape == batch["tokens"].shape and (positions[:, 0] == 0).all()
    steps = positions[:, 1:] - positions[:, :-1]
    assert ((steps == 1) | (positions[:, 1:] == 0)).all() and (positions == 0).sum() > 2
    masked, _ = task.loss(model, batch)
    plain, _ = trainer.next_token_loss(model, batch)
    assert not torch.allclose(masked, plain)
