"""The causal_lm task: unit checks on hand-made batches, then one 2-rank gloo job
(`lm_worker.py`) whose runs several tests read: DDP vs FSDP2, USR2 + resume, elastic 2 → 1,
bf16 + activation checkpointing; and generate/export from its checkpoints.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.data.decode import SampleError
from hpctrain.data.index import ShardIndex, ShardInfo
from hpctrain.data.sequences import num_sequences, sequence_key
from hpctrain.models.gpt import GPT, GPTConfig
from hpctrain.tasks.causal_lm import CausalLM
from hpctrain.tasks.task import load_task
from tests.checkpoint.test_resume_e2e import assert_same_training_state
from tests.support.lm_kit import (
    BYTES_TOKENIZER,
    SEQ_LEN,
    SEQUENCES_PER_SHARD,
    TOKENS_PER_SHARD,
    write_token_shards,
)
from tests.support.train_kit import REPO, run_two_ranks

TOKEN_INDEX = ShardIndex(
    shards=(ShardInfo("a.tar", 10, num_tokens=1000),), tokenizer=dict(BYTES_TOKENIZER)
)
TINY = [
    "causal_lm.dim=32",
    "causal_lm.n_layers=2",
    "causal_lm.n_heads=4",
    f"data.seq_len={SEQ_LEN}",
]


def task(*overrides: str, index: ShardIndex = TOKEN_INDEX) -> CausalLM:
    loaded = load_task(load_config(None, ["task=causal_lm", *TINY, *overrides]), index)
    assert isinstance(loaded, CausalLM)
    return loaded


def batch(num: int = 3, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "tokens": torch.randint(0, 257, (num, SEQ_LEN + 1), generator=g),
        "valid": torch.ones(num, dtype=torch.bool),
        "key": [f"s/{i}" for i in range(num)],
    }


# ---------------------------------------------------------------- the task, no processes


def test_the_model_follows_the_tokenizer_and_model_keys() -> None:
    lm = task("causal_lm.n_kv_heads=2", "causal_lm.tie_embeddings=false")
    model = lm.build_model()
    assert isinstance(model, GPT)
    assert model.cfg == GPTConfig(
        vocab_size=257, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, tie_embeddings=False
    )
    assert lm.tokens_per_sample == SEQ_LEN and lm.flops_per_token() > 0
    assert task("causal_lm.vocab_size=320").build_model().cfg.vocab_size == 320


def test_loss_leaves_invalid_sequences_out() -> None:
    lm = task()
    torch.manual_seed(0)
    model = lm.build_model()
    b = batch()
    b["valid"] = torch.tensor([True, False, True])
    loss, _ = lm.loss(model, b)
    changed = dict(b, tokens=b["tokens"].clone())
    changed["tokens"][1] = (changed["tokens"][1] + 7) % 257  # the filler's content is irrelevant
    loss_changed, _ = lm.loss(model, changed)
    assert torch.equal(loss, loss_changed)
    only_valid = {"tokens": b["tokens"][[0, 2]], "valid": torch.ones(2, dtype=torch.bool)}
    expected, _ = lm.loss(model, only_valid)
    torch.testing.assert_close(loss, expected)
    # the mean over the valid sequences' tokens
    per_token = lm.token_losses(model, b["tokens"])
    torch.testing.assert_close(loss, per_token[[0, 2]].mean())


def test_eval_sums_and_bits_per_byte() -> None:
    lm = task()
    torch.manual_seed(0)
    model = lm.build_model()
    b = batch(4)
    b["valid"] = torch.tensor([True, True, True, False])  # evaluation padding
    with torch.no_grad():
        sums = lm.eval_metrics(model, b)
    assert float(sums["count"]) == 3 and float(sums["tokens"]) == 3 * SEQ_LEN
    metrics = lm.summarize({k: v.double() for k, v in sums.items()})
    loss = float(lm.token_losses(model, b["tokens"]).detach()[:3].mean())
    assert metrics["loss"] == pytest.approx(loss, rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(loss), rel=1e-6)
    assert metrics["bits_per_byte"] == pytest.approx(loss / math.log(2), rel=1e-6)
    # near ln(257) nats at initialisation: the logits start small
    assert loss == pytest.approx(math.log(257), rel=0.05)
    other = ShardIndex(
        shards=TOKEN_INDEX.shards,
        tokenizer={"name": "tok.json", "vocab_size": 300, "eod_id": 0, "sha256": "ab" * 32},
    )
    assert "bits_per_byte" not in task(index=other).summarize({k: v for k, v in sums.items()})


def test_predict_gives_one_record_per_sequence() -> None:
    lm = task()
    model = lm.build_model()
    b = batch(2)
    b["valid"] = torch.tensor([True, False])
    records = lm.predict(model, b)
    assert len(records) == 2 and not {"key", "valid"} & set(records[0])  # the writer's fields
    json.dumps(records)  # JSON-able
    loss = lm.token_losses(model, b["tokens"]).mean(dim=1)
    assert records[0]["loss"] == pytest.approx(float(loss[0]), rel=1e-5)
    assert 0 <= records[1]["accuracy"] <= 1 and 0 <= records[1]["next_token"] < 257


def test_transform_checks_the_sequence() -> None:
    transform = task().train_transform()
    ids = torch.arange(SEQ_LEN + 1, dtype=torch.int32)
    out = transform({"key": "s/0", "tokens": ids, "positions": ids})
    assert out["tokens"].dtype == torch.int64 and out["tokens"].shape == (SEQ_LEN + 1,)
    assert out["positions"].dtype == torch.int64 and torch.equal(out["positions"], ids.long())
    with pytest.raises(SampleError, match=r"'s/0' has no `positions` beside its tokens"):
        transform({"key": "s/0", "tokens": ids})
    # data.document_mask=false: positions are dropped (never travel), none needed
    plain = task("data.document_mask=false").train_transform()
    assert set(plain({"key": "s/0", "tokens": ids, "positions": ids})) == {"key", "tokens"}
    assert set(plain({"key": "s/0", "tokens": ids})) == {"key", "tokens"}
    with pytest.raises(SampleError, match=r"'s/1': tokens of shape \[5\], expected \[33\]"):
        transform({"key": "s/1", "tokens": torch.arange(5)})
    with pytest.raises(SampleError, match=r"'s/2' has no packed `tokens` sequence \(fields: jpg\)"):
        transform({"key": "s/2", "jpg": b""})


def test_document_mask_scores_a_packed_document_as_if_it_were_alone() -> None:
    # a row of document A (9 ids + EOD) then document B (23 ids, continuing past the row)
    lm = task()
    torch.manual_seed(0)
    model = lm.build_model().eval()
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(1, 257, (1, SEQ_LEN + 1), generator=g)
    tokens[0, 9] = 256  # the bytes tokenizer's EOD
    positions = torch.cat([torch.arange(10), torch.arange(SEQ_LEN + 1 - 10)])[None]
    transform = lm.train_transform()
    row = transform({"key": "s/0", "tokens": tokens[0], "positions": positions[0]})
    b = {k: v[None] for k, v in row.items() if k != "key"} | {"valid": torch.ones(1, dtype=bool)}
    with torch.no_grad():
        packed = lm.token_losses(model, b["tokens"], b["positions"])[0, 10:]
        alone = lm.token_losses(model, tokens[:, 10:])[0]
        assert float((packed - alone).abs().max()) < 1e-5
        # training and evaluation read the positions the transform kept
        loss, _ = lm.loss(model, b)
        torch.testing.assert_close(loss, lm.token_losses(model, tokens, positions).mean())
        sums = lm.eval_metrics(model, b)
        torch.testing.assert_close(sums["loss"], lm.token_losses(model, tokens, positions).sum())
        # data.document_mask=false: plain causal attention, B sees A and its losses move
        plain = task("data.document_mask=false").train_transform()
        dropped = plain({"key": "s/0", "tokens": tokens[0], "positions": positions[0]})
        unmasked = lm.token_losses(model, dropped["tokens"][None])[0, 10:]
        assert float((unmasked - alone).abs().max()) > 1e-3


def test_config_errors_name_the_key_and_the_index() -> None:
    with pytest.raises(ConfigError, match=r"data.seq_len=0: task causal_lm trains on packed"):
        task("data.seq_len=0")
    images = ShardIndex(shards=(ShardInfo("a.tar", 10),), base_url="/data/img")
    with pytest.raises(ConfigError, match=r"data.train=x \(/data/img\): not a token index"):
        task("data.train=x", index=images)
    with pytest.raises(ConfigError, match=r"causal_lm.vocab_size=100: smaller than .* \(257\)"):
        task("causal_lm.vocab_size=100")
    with pytest.raises(ConfigError, match=r"model.name='gpt-2': not a GPT preset"):
        task("model.name=gpt-2")


def test_a_tokenizer_mismatch_fails_before_any_work_naming_both(tmp_path: Path) -> None:
    from hpctrain.distributed import DistEnv
    from hpctrain.train.trainer import Trainer

    tokenizer_json = tmp_path / "tok.json"
    tokenizer_json.write_text("{}")
    train = write_token_shards(tmp_path / "train", 1, seed=0)  # converted with bytes
    run_dir = tmp_path / "run"
    cfg = load_config(
        None,
        [
            "task=causal_lm",
            *TINY,
            f"run_dir={run_dir}",
            f"data.train={train}",
            f"data.tokenizer={tokenizer_json}",
        ],
    )
    env = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
    with pytest.raises(ConfigError) as info:
        Trainer(cfg, env, torch.device("cpu"))
    message = str(info.value)
    assert f"data.tokenizer = '{tokenizer_json}'" in message and "'bytes'" in message
    assert f"data.train={train}" in message
    assert not run_dir.exists()  # nothing built, nothing written


def test_val_index_with_another_tokenizer_fails_naming_both(tmp_path: Path) -> None:
    other = dict(BYTES_TOKENIZER, name="tok.json", vocab_size=300, sha256="cd" * 32)
    val = write_token_shards(tmp_path / "val", 1, seed=0, tokenizer=other)
    with pytest.raises(ConfigError) as info:
        task(f"data.val={val}", "data.train=train/index.json")
    message = str(info.value)
    assert f"data.val={val}" in message and "'tok.json'" in message and "'bytes'" in message


# ---------------------------------------------------------------- 2 gloo ranks


@pytest.fixture(scope="module")
def lm_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("lm-shards")
    write_token_shards(root / "train", 4, seed=1)
    write_token_shards(root / "val", 1, seed=2)
    return root


@pytest.fixture(scope="module")
def trained(lm_shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("lm-runs")
    run_two_ranks(
        REPO / "tests" / "support" / "lm_worker.py", str(lm_shards), str(out), timeout=300
    )
    return out


def weights(trained: Path, case: str) -> dict[str, torch.Tensor]:
    return torch.load(trained / f"{case}.pt", weights_only=True)


def records(run_dir: Path, kind: str) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def sample_keys(run_dir: Path) -> list[str]:
    keys = []
    for log in sorted((run_dir / "samples").iterdir()):
        keys.extend(k for line in log.read_text().splitlines() for k in json.loads(line)["keys"])
    return keys


@pytest.mark.distributed
def test_ddp_and_fsdp2_fp32_end_bitwise_equal(trained: Path) -> None:
    ddp, fsdp = weights(trained, "ddp"), weights(trained, "fsdp")
    assert ddp.keys() == fsdp.keys() and "tok_embeddings.weight" in ddp
    assert "output.weight" not in ddp  # gpt-tiny ties them: one matrix under FSDP2's root unit
    for name in ddp:
        assert torch.equal(ddp[name], fsdp[name]), f"{name} differs between DDP and FSDP2"
    for case in ("ddp", "fsdp"):
        train = records(trained / case, "train")
        assert len(train) == 6 and train[-1]["loss"] < train[0]["loss"]
        for r in train:
            assert r["tokens_per_s"] == pytest.approx(r["samples_per_s"] * SEQ_LEN)
            assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / 2)
            assert "mfu" not in r  # a CPU: no peak to compare with, so none is guessed
        (final,) = records(trained / case, "eval")
        assert final["val_samples"] == SEQUENCES_PER_SHARD
        assert final["val_perplexity"] == pytest.approx(math.exp(final["val_loss"]))
        assert final["val_bits_per_byte"] == pytest.approx(final["val_loss"] / math.log(2))


@pytest.mark.distributed
def test_usr2_interrupt_then_resume_is_bitwise_identical(trained: Path) -> None:
    assert (trained / "fsdp-signal.code").read_text() == "75"
    run_dir = trained / "fsdp-signal"
    steps = sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name[:5] == "step-")
    assert steps == ["step-2", "step-3", "step-6"]  # the preemption save, then every 3 steps
    resumed, straight = weights(trained, "fsdp-signal"), weights(trained, "fsdp")
    for name in straight:
        assert torch.equal(resumed[name], straight[name]), f"{name} differs after the resume"
    assert_same_training_state(
        trained / "fsdp" / "checkpoints" / "step-6", run_dir / "checkpoints" / "step-6"
    )
    for rank in (0, 1):
        log = f"samples/rank-{rank}.jsonl"
        assert (run_dir / log).read_text() == (trained / "fsdp" / log).read_text()


@pytest.mark.distributed
def test_elastic_two_ranks_to_one_trains_every_remaining_sequence_once(
    trained: Path, lm_shards: Path
) -> None:
    keys = sample_keys(trained / "elastic")
    assert num_sequences(TOKENS_PER_SHARD, SEQ_LEN) == SEQUENCES_PER_SHARD
    expected = {
        sequence_key(f"shard-{s:06d}", i) for s in range(4) for i in range(SEQUENCES_PER_SHARD)
    }
    assert len(keys) == len(set(keys)) == len(expected), "every sequence of the epoch once"
    assert set(keys) == expected


@pytest.mark.distributed
def test_bf16_fsdp2_with_activation_checkpointing_trains(trained: Path) -> None:
    for name, value in weights(trained, "fsdp-bf16").items():
        assert value.dtype == torch.float32, "master weights stay fp32"
        assert torch.isfinite(value).all(), name
    losses = [r["loss"] for r in records(trained / "fsdp-bf16", "train")]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.distributed
def test_export_pt_and_safetensors_rebuild_the_gpt_from_the_card(
    trained: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from hpctrain.cli.main import main

    expected = weights(trained, "ddp")
    for case, out, load in (
        ("ddp", tmp_path / "ddp.pt", lambda p: torch.load(p, weights_only=True)),
        ("fsdp", tmp_path / "fsdp.pt", lambda p: torch.load(p, weights_only=True)),
        ("fsdp", tmp_path / "fsdp.safetensors", load_file),
    ):
        assert main(["export", str(trained / case), str(out)]) == 0
        card = json.loads(out.with_name(out.name + ".json").read_text())
        assert card["task"] == "causal_lm" and card["seq_len"] == SEQ_LEN and card["step"] == 6
        model = GPT(GPTConfig(**card["model"]))
        model.load_state_dict(load(out))  # strict: exactly the plain model's names
        for name, value in model.state_dict().items():  # FSDP2's export: DDP's weights, bitwise
            assert torch.equal(value, expected[name]), f"{out.name}: {name}"


@pytest.mark.distributed
def test_generate_continues_a_prompt_deterministically(
    trained: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.cli.main import main
    from hpctrain.inference.generate import generate_ids, load_gpt, run_tokenizer

    run_dir = str(trained / "ddp")
    assert main(["generate", run_dir, "--prompt", "the cat ", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("the cat ") and len(printed.rstrip("\n")) > len("the cat ")

    model, tree, step, _ = load_gpt(run_dir)
    assert step == 6 and not model.training
    tokenizer = run_tokenizer(tree)
    prompt = tokenizer.encode("the cat ")

    def continuation(**sampling: Any) -> list[int]:
        return generate_ids(
            model, prompt, max_new_tokens=12, window=SEQ_LEN, stop_id=tokenizer.eod_id, **sampling
        )

    greedy = continuation()
    assert continuation() == greedy  # greedy: the same text every time
    assert printed == "the cat " + tokenizer.decode(greedy) + "\n"  # decode drops the EOD
    sampled = continuation(temperature=1.0, top_k=5, seed=3)
    assert continuation(temperature=1.0, top_k=5, seed=3) == sampled  # the same seed
    assert main(["generate", str(trained), "--prompt", "x"]) == 4  # no checkpoint there


def test_generate_reads_the_weights_the_run_evaluated_with(
    lm_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A run with `train.ema_eval` evaluated its EMA: generate reads it too, unless --no-ema."""
    from hpctrain.cli.main import main
    from hpctrain.inference.generate import load_gpt
    from hpctrain.train.ema import plain_name
    from tests.support.lm_worker import overrides
    from tests.train.test_trainer import build

    run_dir = tmp_path / "run"
    extra = ("train.max_steps=2", "train.ema_decay=0.5", "train.ema_eval=true", "data.val=")
    trainer = build(load_config(None, overrides(lm_shards, run_dir, *extra)))
    assert trainer.fit() == 0 and trainer.ema is not None
    averaged = {plain_name(k): v for k, v in trainer.ema.state_dict().items()}
    trained = {k: v.detach() for k, v in trainer.model.state_dict().items()}
    by_default = load_gpt(str(run_dir)).model
    without = load_gpt(str(run_dir), ema=False).model
    for name, value in by_default.state_dict().items():
        torch.testing.assert_close(value, averaged.get(name, trained[name]), rtol=0, atol=0)
        torch.testing.assert_close(without.state_dict()[name], trained[name], rtol=0, atol=0)
    assert any(not torch.equal(averaged[n], trained[n]) for n in averaged), "EMA == weights"
    greedy = ["generate", str(run_dir), "--prompt", "the ", "--max-new-tokens", "4"]
    capsys.readouterr()  # the training's progress lines
    printed = []
    for option in ("--no-ema", "--ema", None):
        assert main([*greedy, option] if option else greedy) == 0
        printed.append(capsys.readouterr().out)
    assert printed[1] == printed[2] and all(text.startswith("the ") for text in printed), printed


def test_a_tokenizer_file_is_the_one_the_shards_were_converted_with(tmp_path: Path) -> None:
    """predict and generate decode with the file the index names, checked by its sha256."""
    tokenizers = pytest.importorskip("tokenizers")
    from hpctrain.data.tokenizer import load_tokenizer
    from hpctrain.tasks.causal_lm import load_index_tokenizer

    def save_bpe(path: Path, vocab_size: int) -> None:
        tok = tokenizers.Tokenizer(tokenizers.models.BPE())
        tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
        trainer = tokenizers.trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<|endoftext|>"],
            initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(["the cat sat on the mat"] * 20, trainer=trainer)
        tok.save(str(path))

    path = tmp_path / "tokenizer.json"
    save_bpe(path, 270)
    info = load_tokenizer(str(path)).info()
    assert load_index_tokenizer(info).sha256 == info["sha256"]
    save_bpe(path, 265)  # the file changed since the conversion
    with pytest.raises(ConfigError, match=rf"tokenizer {path}: sha256 .* is not that of the file"):
        load_index_tokenizer(info)
