"""Instruction data in training: the `loss_mask` batch field, the causal_lm loss and evaluation
over masked targets only, the loader keeping masks aligned through resume, and a tiny GPT
learning a fixed response to random prompts only when the mask is used."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.config import load_config
from hpctrain.config.schema import DataConfig
from hpctrain.convert.run import ConvertOptions, convert
from hpctrain.data import ShardedLoader, open_index
from hpctrain.data.index import ShardIndex, ShardInfo
from hpctrain.tasks.causal_lm import CausalLM, SequenceTransform
from hpctrain.tasks.task import load_task
from tests.support.instruction_kit import expected_mask, write_instructions
from tests.support.lm_kit import BYTES_TOKENIZER

SEQ_LEN = 32
MASKED_INDEX = ShardIndex(
    shards=(ShardInfo("a.tar", 10, num_tokens=1000, num_targets=300),),
    tokenizer=dict(BYTES_TOKENIZER),
)
TINY = [
    "causal_lm.dim=32",
    "causal_lm.n_layers=2",
    "causal_lm.n_heads=4",
    f"data.seq_len={SEQ_LEN}",
]


@pytest.fixture(scope="module")
def instructions(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """400 prompt/response records as bytes-tokenized shards with a loss mask; the index."""
    root = tmp_path_factory.mktemp("sft")
    write_instructions(root / "sft.jsonl", 400)
    options = ConvertOptions(
        str(root / "sft.jsonl"),
        str(root / "tokens"),
        tokenizer="bytes",
        prompt_field="prompt",
        response_field="response",
        sample_tokens=128,
        samples_per_shard=8,
        progress="none",
    )
    convert(options)
    return root / "tokens" / "index.json"


def task(*overrides: str, index: ShardIndex = MASKED_INDEX) -> CausalLM:
    loaded = load_task(load_config(None, ["task=causal_lm", *TINY, *overrides]), index)
    assert isinstance(loaded, CausalLM)
    return loaded


def test_loss_and_eval_average_over_the_masked_targets_only() -> None:
    lm = task()
    assert lm.loss_mask and not task("data.loss_mask=false").loss_mask
    torch.manual_seed(0)
    model = lm.build_model()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 257, (3, SEQ_LEN + 1), generator=g)
    mask = torch.rand(3, SEQ_LEN + 1, generator=g) < 0.3
    valid = torch.tensor([True, True, False])
    batch = {"tokens": tokens, "loss_mask": mask, "valid": valid}
    loss, values = lm.loss(model, batch)
    per_token = lm.token_losses(model, tokens).detach()
    targets = mask[:, 1:] & valid[:, None]  # loss_mask[t]: token t is a target
    torch.testing.assert_close(loss.detach(), per_token[targets].mean())
    assert values == {} and int(lm.count_targets(batch)) == int(targets.sum())
    assert int(lm.count_targets({"tokens": tokens, "valid": valid})) == 2 * SEQ_LEN  # plain
    with torch.no_grad():
        sums = lm.eval_metrics(model, batch)
    metrics = lm.summarize(sums)
    assert metrics["targets"] == int(targets.sum()) and float(sums["count"]) == 2
    assert metrics["loss"] == pytest.approx(float(per_token[targets].mean()), rel=1e-5)


def test_the_transform_passes_fills_or_drops_the_mask() -> None:
    tokens = torch.arange(SEQ_LEN + 1)
    positions = torch.arange(SEQ_LEN + 1)
    mask = tokens % 2 == 0
    sample = {"key": "s/0", "tokens": tokens, "positions": positions, "loss_mask": mask}
    assert torch.equal(SequenceTransform(SEQ_LEN, loss_mask=True)(sample)["loss_mask"], mask)
    plain = {k: v for k, v in sample.items() if k != "loss_mask"}
    filled = SequenceTransform(SEQ_LEN, loss_mask=True)(plain)["loss_mask"]
    assert filled.dtype == torch.bool and filled.all()  # plain text: every token a target
    assert "loss_mask" not in SequenceTransform(SEQ_LEN, loss_mask=False)(sample)


def loader_cfg(**kw: object) -> DataConfig:
    base: dict[str, object] = dict(
        seq_len=SEQ_LEN, batch_size=4, workers_per_rank=0, shuffle_buffer=4
    )
    return DataConfig(**{**base, **kw})  # type: ignore[arg-type]


def assert_aligned(batch: dict) -> None:
    for ids, mask in zip(batch["tokens"], batch["loss_mask"], strict=True):
        assert mask.dtype == torch.bool and mask.shape == (SEQ_LEN + 1,)
        assert np.array_equal(mask.numpy(), expected_mask(ids.numpy()))


def test_loader_masks_stay_aligned_through_exact_and_elastic_resume(instructions: Path) -> None:
    index = open_index(str(instructions))
    assert index.num_targets is not None
    c = loader_cfg()
    full = list(ShardedLoader(index, c, rank=0, world_size=1, seed=3))
    for batch in full:
        assert_aligned(batch)
    # exact resume: the same remaining batches, masks included
    first = ShardedLoader(index, c, rank=0, world_size=1, seed=3)
    it = iter(first)
    for _ in range(3):
        next(it)
    state = first.state_dict()
    first.close()
    resumed = ShardedLoader(index, c, rank=0, world_size=1, seed=3)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == len(full) - 3
    for a, b in zip(full[3:], rest, strict=True):
        assert a["key"] == b["key"] and torch.equal(a["loss_mask"], b["loss_mask"])
    # elastic 2 -> 1: re-planned, scattered sequences keep their masks
    seen: list[str] = []
    states = []
    for rank in range(2):
        loader = ShardedLoader(index, c, rank=rank, world_size=2, seed=1)
        it = iter(loader)
        for _ in range(2):
            seen.extend(next(it)["key"])
        states.append(loader.state_dict())
    loader = ShardedLoader(index, c, rank=0, world_size=1, seed=1)
    loader.load_state_dict(states[0])
    for batch in loader:
        assert_aligned(batch)
        seen += [k for k, ok in zip(batch["key"], batch["valid"], strict=True) if ok]
    assert set(Counter(seen).values()) == {1}


def train_losses(index: Path, run_dir: Path, *extra: str) -> list[dict]:
    from tests.train.test_trainer import build

    overrides = [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={index}",
        "data.val=",
        *TINY,
        "data.batch_size=8",
        "data.workers_per_rank=0",
        "train.max_steps=100",
        "train.lr=0.01",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.log_every=10",
        "checkpoint.every_steps=1000",
        "logging.progress=lines",
        *extra,
    ]
    assert build(load_config(None, overrides)).fit() == 0
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "train"]


def test_a_fixed_response_is_learned_with_the_mask_and_not_without(
    instructions: Path, tmp_path: Path
) -> None:
    # 100 steps of 8 sequences: below 0.3 nats by step ~40 with the mask, ~1.3 without
    masked = train_losses(instructions, tmp_path / "masked")
    assert masked[-1]["loss"] < 0.3, [r["loss"] for r in masked]
    # the targets the loss counted: the responses' share of the batch's tokens
    index = open_index(str(instructions))
    share = index.num_targets / index.num_tokens  # type: ignore[operator]
    counted = np.mean([r["targets"] for r in masked]) / (8 * SEQ_LEN)
    assert counted == pytest.approx(share, abs=0.05)
    plain = train_losses(instructions, tmp_path / "plain", "data.loss_mask=false")
    assert plain[-1]["targets"] == 8 * SEQ_LEN  # every position of every sequence
    assert min(r["loss"] for r in plain) > 0.3  # random letters cannot be predicted


@pytest.mark.parametrize(
    ("layout", "message"),
    [
        ([("0.loss_mask.bits", 4), ("0.tokens.u16", 4), ("1.tokens.u16", 4)], "has no loss_mask"),
        ([("0.tokens.u16", 4), ("0.loss_mask.bits", 4)], "comes after its token member"),
        ([("0.loss_mask.bits", 20), ("0.tokens.u16", 4)], "bytes, but 4 tokens need 1"),
    ],
)
def test_a_mask_that_does_not_fit_its_ids_is_a_data_error(
    tmp_path: Path, layout: list[tuple[str, int]], message: str
) -> None:
    import io
    import tarfile

    from hpctrain.data.sequences import TokenDataError, iter_sequences
    from hpctrain.data.stream import open_shard
    from hpctrain.data.tokens import encode_loss_mask, encode_tokens

    path = tmp_path / "s.tar"
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, n in layout:
            data = encode_tokens([1] * n, "tokens.u16") if "tokens" in name else b""
            if "loss_mask" in name:
                data = encode_loss_mask([True] * n)
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with open_shard(str(path)) as f, pytest.raises(TokenDataError, match=message):
        list(iter_sequences(f, [0, 1, 2], 2, 257, "s"))


def test_predict_averages_each_sequence_over_its_masked_targets() -> None:
    lm = task()
    torch.manual_seed(0)
    model = lm.build_model()
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 257, (3, SEQ_LEN + 1), generator=g)
    mask = torch.zeros(3, SEQ_LEN + 1, dtype=torch.bool)
    mask[0, -5:] = True  # a response of 5 tokens after its prompt
    mask[1, 1:] = True  # every token a target
    # row 2: a prompt that fills the sequence: no target
    batch = {"tokens": tokens, "loss_mask": mask, "valid": torch.ones(3, dtype=torch.bool)}
    rows = lm.predict(model, batch)
    per_token = lm.token_losses(model, tokens).detach()
    assert [r["targets"] for r in rows] == [5, SEQ_LEN, 0]
    assert rows[0]["loss"] == pytest.approx(float(per_token[0, -5:].mean()), rel=1e-5)
    assert rows[1]["loss"] == pytest.approx(float(per_token[1].mean()), rel=1e-5)
    assert rows[2]["loss"] is None and rows[2]["accuracy"] is None
    # plain text: every position counts, as before
    plain = lm.predict(model, {"tokens": tokens, "valid": batch["valid"]})
    assert plain[0]["targets"] == SEQ_LEN
    assert plain[0]["loss"] == pytest.approx(float(per_token[0].mean()), rel=1e-5)
    # evaluation and prediction read the data's own masks even when training had none
    plain_task = task(index=ShardIndex(shards=(ShardInfo("a.tar", 10, num_tokens=1000),),
                                       tokenizer=dict(BYTES_TOKENIZER)))  # fmt: skip
    assert not plain_task.loss_mask
    sample = {"key": "s/0", "tokens": tokens[0], "positions": torch.arange(SEQ_LEN + 1),
              "loss_mask": mask[0]}  # fmt: skip
    assert torch.equal(plain_task.eval_transform()(sample)["loss_mask"], mask[0])


@pytest.mark.slow
def test_predicted_losses_weighed_by_targets_give_the_evaluation_loss(
    instructions: Path, tmp_path: Path
) -> None:
    from hpctrain.inference.evaluate import run_eval
    from hpctrain.inference.predict import run_predict

    train_losses(instructions, tmp_path / "run", "train.max_steps=3", "train.log_every=1")
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            "task=causal_lm",
            f"data.train={instructions}",
            f"data.val={instructions}",
            *TINY,
            "data.batch_size=8",
            "data.workers_per_rank=0",
            "train.precision=fp32",
        ],
    )
    out = tmp_path / "eval.json"
    assert run_eval(cfg, out=str(out)) == 0
    evaluated = json.loads(out.read_text())
    assert run_predict(cfg, data=str(instructions), out=str(tmp_path / "pred")) == 0
    rows = [
        json.loads(line)
        for part in sorted((tmp_path / "pred").glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    ]
    counted = [r for r in rows if r["targets"]]
    total = sum(r["targets"] for r in counted)
    assert total == evaluated["val_targets"] and total < len(rows) * SEQ_LEN
    weighed = sum(r["loss"] * r["targets"] for r in counted) / total
    assert weighed == pytest.approx(evaluated["val_loss"], rel=1e-4)


def test_an_evaluation_without_a_target_reports_no_loss_rather_than_zero() -> None:
    # the evaluation sibling of #37 item 4: instruction data whose prompts fill every
    # sequence (no mask bit set) evaluated to val_loss 0.0, a perfect score
    lm = task()
    torch.manual_seed(0)
    model = lm.build_model()
    tokens = torch.randint(0, 257, (2, SEQ_LEN + 1))
    batch = {"tokens": tokens, "loss_mask": torch.zeros(2, SEQ_LEN + 1, dtype=torch.bool),
             "valid": torch.ones(2, dtype=torch.bool)}  # fmt: skip
    with torch.no_grad():
        metrics = lm.summarize(lm.eval_metrics(model, batch))
    assert metrics["targets"] == 0
    assert np.isnan(metrics["loss"]) and np.isnan(metrics["perplexity"])
