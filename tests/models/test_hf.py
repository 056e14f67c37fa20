"""Hugging Face folders in (`model.init_from`) and out (`export --format hf`), checked against
the real transformers library on tiny random models it builds and saves itself (no download)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.config import ConfigError, load_config
from hpctrain.distributed import DistEnv
from hpctrain.models import hf
from hpctrain.models.gpt import GPT
from hpctrain.train.trainer import Trainer
from tests.support.lm_kit import SEQ_LEN, write_token_shards
from tests.support.train_kit import REPO, run_two_ranks

transformers = pytest.importorskip("transformers")

SHAPE = {
    "vocab_size": 97,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-5,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # small, so that the 24-token test sequence spans scaled, smoothed and kept frequencies
    "original_max_position_embeddings": 16,
}


def save_hf(folder: Path, kind: str, *, seed: int = 0, shard: bool = False, **extra: Any) -> Any:
    """A tiny random transformers model of `kind`, saved to `folder`; returns the model."""
    config_class = {
        "llama": transformers.LlamaConfig,
        "mistral": transformers.MistralConfig,
        "qwen2": transformers.Qwen2Config,
    }[kind]
    rope = extra.pop("rope_scaling", None)
    config = config_class(**{**SHAPE, **extra})
    if rope is not None:  # transformers 5 keeps RoPE settings in rope_parameters
        if hasattr(config, "rope_parameters"):
            config.rope_parameters = {**rope, "rope_theta": 500000.0}
        else:
            config.rope_scaling, config.rope_theta = rope, 500000.0
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    if kind == "qwen2":  # random, non-zero biases: zeros would hide a biasless import
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_()
    model.save_pretrained(folder, max_shard_size="20KB" if shard else "5GB")
    return model


def imported(folder: Path) -> GPT:
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(str(folder)), str(folder))
    model = GPT(cfg).eval()
    hf.load_hf_weights(model, str(folder), cfg)
    return model


def tokens(vocab: int = 97, length: int = 24) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    ("kind", "extra"),
    [
        ("llama", {"tie_word_embeddings": False}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"rope_scaling": LLAMA3_ROPE}),
        ("mistral", {"sliding_window": None}),
        ("qwen2", {"tie_word_embeddings": True}),
    ],
    ids=["llama-untied", "llama-tied", "llama3-rope", "mistral", "qwen2"],
)
def test_init_from_gives_transformers_logits(tmp_path: Path, kind: str, extra: dict) -> None:
    reference = save_hf(tmp_path, kind, **extra)
    model = imported(tmp_path)
    if extra.get("rope_scaling"):
        assert model.cfg.rope_scaling_factor == 8.0 and model.cfg.rope_theta == 500000.0
    assert model.cfg.qkv_bias == (kind == "qwen2")
    assert model.cfg.tie_embeddings == bool(extra.get("tie_word_embeddings", False))
    with torch.no_grad():
        expected = reference(tokens()).logits
        torch.testing.assert_close(model(tokens()), expected, rtol=0, atol=1e-5)


def test_sharded_folder_loads_from_its_index(tmp_path: Path) -> None:
    reference = save_hf(tmp_path, "llama", shard=True)
    assert (tmp_path / hf.INDEX).is_file() and not (tmp_path / hf.WEIGHTS).exists()
    with torch.no_grad():
        torch.testing.assert_close(
            imported(tmp_path)(tokens()), reference(tokens()).logits, rtol=0, atol=1e-5
        )


def test_other_architecture_is_refused_naming_it(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ConfigError, match=r"model.init_from=.*GPT2LMHeadModel"):
        hf.read_hf_config(str(tmp_path))


def test_missing_path_and_hub_name_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"^model.init_from=\S+: no such file or folder$"):
        hf.check_path(str(tmp_path / "absent"))
    # the command huggingface_hub installs today, and the one older versions have
    hub = r"`hf download meta-llama/Llama-3.2-1B --local-dir DIR` \(`huggingface-cli download` "
    with pytest.raises(ConfigError, match=hub + "with huggingface_hub older than 0.34"):
        hf.check_path("meta-llama/Llama-3.2-1B")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    save_hf(tmp_path, "llama")
    from safetensors.torch import load_file, save_file

    weights = load_file(tmp_path / hf.WEIGHTS)
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / hf.WEIGHTS)
    with pytest.raises(ConfigError, match=r"model.layers.1.mlp.up_proj.weight"):
        imported(tmp_path)


# ---------------------------------------------------------------- runs

LM_VOCAB = 301  # above the bytes tokenizer's 257 ids; odd: FSDP2 shards it unevenly


def run_overrides(folder: Path, shards: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"model.init_from={folder}",
        f"data.train={shards / 'train' / 'index.json'}",
        f"data.val={shards / 'val' / 'index.json'}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.workers_per_rank=0",
        "train.max_steps=1",
        "train.lr=0",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "checkpoint.every_steps=1",
        "logging.progress=lines",
        *extra,
    ]


@pytest.fixture(scope="module")
def lm_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hf-shards")
    write_token_shards(root / "train", 1, seed=1)
    write_token_shards(root / "val", 1, seed=2)
    return root


def train_here(folder: Path, shards: Path, run_dir: Path, *extra: str) -> Trainer:
    cfg = load_config(None, run_overrides(folder, shards, run_dir, *extra))
    trainer = Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    assert trainer.fit() == 0
    return trainer


def test_a_new_run_starts_from_the_folder_and_a_second_resumes(
    tmp_path: Path, lm_shards: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "llama"
    reference = save_hf(folder, "llama", vocab_size=LM_VOCAB, tie_word_embeddings=True)
    run_dir = tmp_path / "run"
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        trainer = train_here(folder, lm_shards, run_dir)
    assert f"a new run from step 0: weights from model.init_from={folder}" in caplog.text
    assert trainer.state.step == 1
    assert "converted with" not in caplog.text  # the folder has no tokenizer.json
    with torch.no_grad():  # lr 0: the weights are still the folder's
        logits = trainer.model.eval()(tokens(LM_VOCAB))
        torch.testing.assert_close(logits, reference(tokens(LM_VOCAB)).logits, rtol=0, atol=1e-5)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        train_here(folder, lm_shards, run_dir, "train.max_steps=2")
    assert "not read: the run resumes" in caplog.text and "resumed from step 1" in caplog.text


def test_bad_init_from_is_one_line_naming_the_key(tmp_path: Path, lm_shards: Path) -> None:
    small = tmp_path / "small"
    save_hf(small, "llama")  # 97 ids < the bytes tokenizer's 257
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    sharded = tmp_path / "sharded"
    save_hf(sharded, "llama", vocab_size=LM_VOCAB, shard=True)
    cases = {
        str(sharded / hf.INDEX): r"a JSON file \(an index or a model card\), not weights",
        str(small): r"vocab_size 97 is smaller than the vocabulary .* \(257\)",
        str(tmp_path / "absent"): r"no such file or folder",
        "meta-llama/Llama-3.2-1B": r"hf download meta-llama/Llama-3.2-1B --local-dir",
        str(gpt2): r"GPT2LMHeadModel",
    }
    for init_from, message in cases.items():
        cfg = load_config(None, run_overrides(Path(init_from), lm_shards, tmp_path / "run"))
        env = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")
        with pytest.raises(ConfigError, match=message) as info:
            Trainer(cfg, env, torch.device("cpu"))
        assert str(info.value).startswith(f"model.init_from={init_from}")
        assert "\n" not in str(info.value)
    windowed = tmp_path / "mistral"
    save_hf(windowed, "mistral", vocab_size=LM_VOCAB, sliding_window=8)
    with pytest.raises(ConfigError, match=r"^data.seq_len=32: longer than the sliding_window 8"):
        Trainer(
            load_config(None, run_overrides(windowed, lm_shards, tmp_path / "r")),
            DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"),
            torch.device("cpu"),
        )
    with pytest.raises(
        ConfigError, match=r"causal_lm.dim=64 disagrees with model.init_from=.*: 32"
    ):
        Trainer(
            load_config(
                None, [*run_overrides(small, lm_shards, tmp_path / "r"), "causal_lm.dim=64"]
            ),
            DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"),
            torch.device("cpu"),
        )


def write_tokenizer_json(path: Path) -> dict[str, Any]:
    """A tokenizer.json of the test shards' 257 ids (256 words, then `<|endoftext|>` = 256);
    returns the index's tokenizer object for it."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    from hpctrain.data.tokenizer import file_sha256

    vocab = {f"w{i}": i for i in range(256)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(["<|endoftext|>"])
    tokenizer.save(str(path))
    return {"name": str(path), "vocab_size": 257, "eod_id": 256, "sha256": file_sha256(str(path))}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(HF folder, FSDP2 run folder, the transformers model): shards of a tokenizer.json's
    ids, 2 gloo ranks, 1 step at lr 0 with FSDP2 (and into RUN-ddp with DDP)."""
    root = tmp_path_factory.mktemp("hf-fsdp")
    info = write_tokenizer_json(root / "tokenizer.json")
    lm_shards = root / "shards"
    write_token_shards(lm_shards / "train", 1, seed=1, tokenizer=info)
    write_token_shards(lm_shards / "val", 1, seed=2, tokenizer=info)
    folder = root / "qwen2"
    reference = save_hf(folder, "qwen2", vocab_size=LM_VOCAB, tie_word_embeddings=False)
    run_dir = root / "run"
    worker = REPO / "tests" / "support" / "hf_worker.py"
    run_two_ranks(worker, str(folder), str(lm_shards), str(run_dir), timeout=300)
    return folder, run_dir, reference


@pytest.mark.distributed
@pytest.mark.parametrize("suffix", ["", "-ddp"], ids=["fsdp2", "ddp"])
def test_two_ranks_load_the_folder(fsdp_run: tuple, suffix: str) -> None:
    """FSDP2: each rank reads its own rows (an odd vocabulary shards unevenly); DDP: names
    under `module.`."""
    folder, run_dir, _ = fsdp_run
    from safetensors.torch import load_file

    from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights

    store, name, manifest = locate_checkpoint(f"{run_dir}{suffix}")
    saved = read_model_weights(store, name, manifest)
    source = load_file(folder / hf.WEIGHTS)
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(str(folder)), str(folder))
    assert saved.keys() == hf.hf_names(cfg).keys()
    for ours, theirs in hf.hf_names(cfg).items():
        assert torch.equal(saved[ours], source[theirs]), ours


@pytest.mark.distributed
def test_export_hf_loads_in_transformers_with_the_same_logits(
    fsdp_run: tuple, tmp_path: Path
) -> None:
    from hpctrain.cli.main import main

    _, run_dir, reference = fsdp_run
    out = tmp_path / "exported"
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == "Qwen2ForCausalLM"  # the architecture imported from
    with torch.no_grad():
        expected = reference(tokens(LM_VOCAB)).logits
        torch.testing.assert_close(model(tokens(LM_VOCAB)).logits, expected, rtol=0, atol=1e-5)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    assert tokenizer.eos_token == "<|endoftext|>" and tokenizer.eos_token_id == 256
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 256
    # an existing folder with files is never written into
    assert main(["export", str(run_dir), str(out), "--format", "hf"]) != 0


def test_export_hf_shards_above_the_threshold(tmp_path: Path, lm_shards: Path) -> None:
    from hpctrain.inference.export import export_hf

    folder = tmp_path / "llama"
    reference = save_hf(folder, "llama", vocab_size=LM_VOCAB, rope_scaling=LLAMA3_ROPE)
    train_here(folder, lm_shards, tmp_path / "run")
    out = tmp_path / "exported"
    export_hf(str(tmp_path / "run"), out, shard_bytes=20_000)
    assert (out / hf.INDEX).is_file() and len(list(out.glob("model-*.safetensors"))) > 1
    assert not (out / "tokenizer.json").exists()  # the bytes tokenizer has no such file
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        expected = reference(tokens(LM_VOCAB)).logits
        torch.testing.assert_close(model(tokens(LM_VOCAB)).logits, expected, rtol=0, atol=1e-5)


def test_export_hf_refuses_a_vision_run_naming_the_formats(tmp_path: Path) -> None:
    from hpctrain.config import Config, with_overrides
    from hpctrain.errors import UsageError
    from hpctrain.inference.export import export_hf
    from tests.train.test_export_formats import save_checkpoints

    cfg = with_overrides(Config(), ["model.name=small_cnn", "model.image_size=16"])
    save_checkpoints(tmp_path / "ck", cfg, 2, {1: 0.5})
    with pytest.raises(UsageError, match=r"^--format hf: .*--format pt or --format safetensors$"):
        export_hf(str(tmp_path / "ck"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fine_tuned_export_has_the_loss_hpctrain_evaluated(tmp_path: Path, lm_shards: Path) -> None:
    from hpctrain.inference.export import export_hf

    folder = tmp_path / "mistral"
    save_hf(folder, "mistral", vocab_size=LM_VOCAB, sliding_window=None)
    run_dir = tmp_path / "run"
    trainer = train_here(folder, lm_shards, run_dir, "train.max_steps=3", "train.lr=0.01")
    evals = [
        json.loads(line)
        for line in (run_dir / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    out = tmp_path / "exported"
    moved = folder.rename(tmp_path / "moved")  # the checkpoint records what the export needs
    export_hf(str(run_dir), out)
    model = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    assert type(model).__name__ == "MistralForCausalLM"
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in trainer.val_loader:
            sequences = batch["tokens"][batch["valid"]]
            logits = model(sequences[:, :-1]).logits
            total += float(
                torch.nn.functional.cross_entropy(
                    logits.flatten(0, 1), sequences[:, 1:].flatten(), reduction="sum"
                )
            )
            count += sequences[:, 1:].numel()
    assert count > 0
    assert total / count == pytest.approx(evals[-1]["val_loss"], rel=1e-4)
    before = json.loads((moved / "config.json").read_text())
    assert before["vocab_size"] == LM_VOCAB  # the source folder is untouched


def test_wrapped_blocks_load_under_their_plain_names(tmp_path: Path) -> None:
    """parallelize wraps blocks in activation checkpointing, then torch.compile: their
    parameter names gain `_checkpoint_wrapped_module.` and `_orig_mod.` (not run here: a
    compiled call needs a compiler; the wrappers' names are what the load must map)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    reference = save_hf(tmp_path, "qwen2")
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(str(tmp_path)), str(tmp_path))
    model = GPT(cfg).eval()
    plain = list(model.blocks)
    for i, block in enumerate(plain):
        model.blocks[i] = torch.compile(checkpoint_wrapper(block))
    assert any("_orig_mod._checkpoint_wrapped_module" in n for n, _ in model.named_parameters())
    hf.load_hf_weights(model, str(tmp_path), cfg)
    for i, block in enumerate(plain):
        model.blocks[i] = block
    with torch.no_grad():
        torch.testing.assert_close(model(tokens()), reference(tokens()).logits, rtol=0, atol=1e-5)


def test_warm_start_from_an_imported_run_takes_its_recorded_shape(
    tmp_path: Path, lm_shards: Path
) -> None:
    from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights

    folder = tmp_path / "qwen2"
    save_hf(folder, "qwen2", vocab_size=LM_VOCAB, tie_word_embeddings=True)
    first = tmp_path / "first"
    train_here(folder, lm_shards, first, "train.lr=0.01")
    # no model.* keys: the shape (q/k/v biases included) is the checkpoint's
    second = train_here(first, lm_shards, tmp_path / "second")
    assert second.task.model_cfg.qkv_bias and second.task.model_cfg.dim == 32
    store, name, manifest = locate_checkpoint(str(first))
    expected = read_model_weights(store, name, manifest)
    weights = second.model.state_dict()
    assert all(torch.equal(weights[k], v) for k, v in expected.items())


def test_qkv_biases_are_counted_in_the_parameters(tmp_path: Path) -> None:
    from hpctrain.models.gpt import num_params

    save_hf(tmp_path, "qwen2")
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(str(tmp_path)), str(tmp_path))
    assert cfg.qkv_bias
    assert sum(p.numel() for p in GPT(cfg).parameters()) == num_params(cfg)


def test_the_ema_starts_from_the_imported_weights(tmp_path: Path, lm_shards: Path) -> None:
    from safetensors.torch import load_file

    from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights

    folder = tmp_path / "llama"
    save_hf(folder, "llama", vocab_size=LM_VOCAB)
    run_dir = tmp_path / "run"
    train_here(folder, lm_shards, run_dir, "train.ema_decay=0.5")  # lr 0: weights stay
    store, name, manifest = locate_checkpoint(str(run_dir))
    averaged = read_model_weights(store, name, manifest, ema=True)
    source = load_file(folder / hf.WEIGHTS)
    cfg = hf.gpt_config_from_hf(hf.read_hf_config(str(folder)), str(folder))
    for ours, theirs in hf.hf_names(cfg).items():
        assert torch.equal(averaged[ours], source[theirs]), ours


def test_shards_of_another_tokenizer_than_the_folders_are_warned_about(
    tmp_path: Path, lm_shards: Path, caplog: pytest.LogCaptureFixture
) -> None:
    folder = tmp_path / "llama"
    save_hf(folder, "llama", vocab_size=LM_VOCAB)
    write_tokenizer_json(folder / "tokenizer.json")
    cfg = load_config(None, run_overrides(folder, lm_shards, tmp_path / "run"))
    with caplog.at_level(logging.WARNING, logger="hpctrain"):
        Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu"))
    assert "were converted with bytes, not with the folder's tokenizer.json" in caplog.text
