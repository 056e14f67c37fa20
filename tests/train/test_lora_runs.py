"""LoRA runs in this process: a tiny Hugging Face Llama (saved by transformers) fine-tuned with
adapters, its checkpoints (adapters only, the base's fingerprint), an exact resume, a resume
or an eval on a changed base refused, and the same numbers everywhere after: eval, generate,
`export --format hf` (merged, loaded by transformers), `--format peft` (loaded by peft), and
back in with `model.lora.init_from`. A torchvision ViT with a new head and QLoRA close it.
Several ranks: tests/parallel/test_lora_ranks.py."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint import CheckpointError
from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights, weight_entries
from hpctrain.cli.main import main
from hpctrain.config import ConfigError, load_config
from hpctrain.distributed import DistEnv
from hpctrain.models import lora
from hpctrain.train.preemption import REQUEUE_EXIT_CODE
from hpctrain.train.trainer import Trainer
from tests.models.test_hf import LM_VOCAB, save_hf, tokens
from tests.support.lm_kit import SEQ_LEN, write_token_shards

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.slow

SINGLE = DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single")


@pytest.fixture(scope="module")
def lm(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/llama (a tiny random Llama) and ROOT/shards/{train,val} (byte tokens)."""
    root = tmp_path_factory.mktemp("lora")
    write_token_shards(root / "shards" / "train", 1, seed=1)
    write_token_shards(root / "shards" / "val", 1, seed=2)
    save_hf(root / "llama", "llama", vocab_size=LM_VOCAB)
    return root


def lora_overrides(root: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"model.init_from={root / 'llama'}",
        "model.lora.rank=4",
        "model.lora.alpha=8",
        f"data.train={root / 'shards' / 'train' / 'index.json'}",
        f"data.val={root / 'shards' / 'val' / 'index.json'}",
        f"data.seq_len={SEQ_LEN}",
        "data.batch_size=2",
        "data.workers_per_rank=0",
        "train.max_steps=3",
        "train.lr=0.02",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "train.deterministic=true",
        "train.strategy=none",
        "checkpoint.every_steps=1",
        "logging.progress=lines",
        *extra,
    ]


def train(root: Path, run_dir: Path, *extra: str) -> Trainer:
    trainer = Trainer(
        load_config(None, lora_overrides(root, run_dir, *extra)), SINGLE, torch.device("cpu")
    )
    assert trainer.fit() == 0
    return trainer


def adapters(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        k: v.detach().clone() for k, v in trainer.model.state_dict().items() if lora.is_adapter(k)
    }


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        out = model.eval()(tokens(LM_VOCAB))
    return out if isinstance(out, torch.Tensor) else out.logits


@pytest.fixture(scope="module")
def lora_run(lm: Path) -> tuple[Path, Trainer]:
    run_dir = lm / "run"
    return run_dir, train(lm, run_dir)


def test_checkpoints_hold_the_adapters_and_the_base_fingerprint(lora_run: tuple, lm: Path) -> None:
    run_dir, trainer = lora_run
    store, name, manifest = locate_checkpoint(str(run_dir))
    entries = weight_entries(store, name)
    assert entries and all(lora.is_adapter(k) for k in entries)  # no base weight
    assert len(entries) == 2 * 7 * 2  # A and B of 7 projections in 2 blocks
    recorded = manifest["metadata"]["lora"]
    assert recorded["rank"] == 4 and recorded["alpha"] == 8.0
    assert recorded["base"]["path"] == str((lm / "llama").resolve())
    assert recorded["base"]["kind"] == "hf" and len(recorded["base"]["digest"]) == 64
    # the adapters trained; the base did not
    assert any(v.abs().sum() > 0 for k, v in adapters(trainer).items() if ".lora_B." in k)
    held = sum(math.prod(entry.size) for _, entry in entries.values())
    assert held < trainer.adapted.num_total / 4  # the size on gpt-125m: hpctrain bench lora


def test_eval_generate_and_merged_exports_give_the_runs_numbers(
    lora_run: tuple, lm: Path, tmp_path: Path
) -> None:
    run_dir, trainer = lora_run
    expected = logits(trainer.model)
    from hpctrain.inference.generate import load_gpt

    torch.testing.assert_close(logits(load_gpt(str(run_dir))[0]), expected, rtol=0, atol=1e-4)
    assert main(["eval", str(run_dir)]) == 0
    (record_file,) = (run_dir / "eval").glob("step-3.val-*.json")
    record = json.loads(record_file.read_text())
    final = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    trained_eval = [r for r in final if r.get("kind") == "eval"][-1]
    assert record["val_loss"] == pytest.approx(trained_eval["val_loss"], abs=1e-5)
    hf_out = tmp_path / "merged"
    assert main(["export", str(run_dir), str(hf_out), "--format", "hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(hf_out).float()
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-4)
    adapter_out = tmp_path / "adapter"
    assert main(["export", str(run_dir), str(adapter_out), "--format", "peft"]) == 0
    config = json.loads((adapter_out / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert config["target_modules"] == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    )
    base = transformers.AutoModelForCausalLM.from_pretrained(lm / "llama").float()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter_out)
    torch.testing.assert_close(logits(with_adapter), expected, rtol=0, atol=1e-4)


def test_adapters_come_back_in_from_peft_and_from_the_run(
    lora_run: tuple, lm: Path, tmp_path: Path
) -> None:
    run_dir, trainer = lora_run
    adapter_out = tmp_path / "adapter"
    assert main(["export", str(run_dir), str(adapter_out), "--format", "peft"]) == 0
    for source in (adapter_out, run_dir):
        again = train(
            lm,
            tmp_path / f"from-{source.name}",
            "train.max_steps=1",
            "train.lr=0",
            f"model.lora.init_from={source}",
        )
        for key, value in adapters(trainer).items():
            assert torch.equal(adapters(again)[key], value), (source, key)
    with pytest.raises(
        ConfigError, match=r"adapters of rank 4 and alpha 8.0; this run's are model.lora.rank=2"
    ):
        train(lm, tmp_path / "rank2", "model.lora.rank=2", f"model.lora.init_from={adapter_out}")
    warm = [*lora_overrides(lm, tmp_path / "warm"), f"model.init_from={run_dir}"]
    with pytest.raises(
        ConfigError, match=r"^model.init_from=.*: a LoRA run \(its checkpoints hold"
    ):
        Trainer(load_config(None, [*warm, "model.lora.rank=0"]), SINGLE, torch.device("cpu"))


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_peft_equals_the_merged_export_when_the_embedding_trains_in_full(
    lm: Path, tmp_path: Path, tied: bool
) -> None:
    """A tied base's embedding is also its output head: trained in full, the peft adapter
    holds it for both (peft keeps a copy of each module to save, and its lm_head would
    stay tied to the base's untrained embedding)."""
    (tmp_path / "shards").symlink_to(lm / "shards")
    save_hf(tmp_path / "llama", "llama", vocab_size=LM_VOCAB, tie_word_embeddings=tied)
    run_dir = tmp_path / "run"
    saved = "model.lora.modules_to_save=[tok_embeddings,norm]"
    trainer = train(tmp_path, run_dir, "train.max_steps=2", saved)
    expected = logits(trainer.model)
    assert main(["export", str(run_dir), str(tmp_path / "merged"), "--format", "hf"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float()
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-4)
    adapter_out = tmp_path / "adapter"
    assert main(["export", str(run_dir), str(adapter_out), "--format", "peft"]) == 0
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama").float()
    with_adapter = peft.PeftModel.from_pretrained(base, adapter_out)
    torch.testing.assert_close(logits(with_adapter), expected, rtol=0, atol=1e-4)
    # and back in: the same embedding, norm and adapters
    again = train(
        tmp_path,
        tmp_path / "again",
        "train.max_steps=1",
        "train.lr=0",
        saved,
        f"model.lora.init_from={adapter_out}",
    )
    torch.testing.assert_close(logits(again.model), expected, rtol=0, atol=0)
    if tied:  # a head other than the embedding cannot be tied to it
        from safetensors.torch import load_file, save_file

        tensors = load_file(adapter_out / "adapter_model.safetensors")
        tensors["base_model.model.lm_head.weight"] += 1
        save_file(tensors, adapter_out / "adapter_model.safetensors")
        with pytest.raises(ConfigError, match="holds an lm_head other than its embedding"):
            train(tmp_path, tmp_path / "other", saved, f"model.lora.init_from={adapter_out}")


def test_a_preempted_run_resumes_exactly(lm: Path, tmp_path: Path) -> None:
    from tests.support.finetune_worker import signal_after_step

    options = ("train.max_steps=4", "model.lora.dropout=0.1", "checkpoint.every_steps=0")
    straight = adapters(train(lm, tmp_path / "straight", *options))
    cfg = load_config(None, lora_overrides(lm, tmp_path / "split", *options))
    first = Trainer(cfg, SINGLE, torch.device("cpu"))
    signal_after_step(first, 2)  # a real SIGUSR2: the run saves step 2 and asks for a requeue
    assert first.fit() == REQUEUE_EXIT_CODE
    resumed = Trainer(cfg, SINGLE, torch.device("cpu"))
    assert resumed.fit() == 0 and resumed.state.step == 4
    for key, value in straight.items():
        assert torch.equal(adapters(resumed)[key], value), key


def test_a_changed_base_is_refused_naming_both_fingerprints(tmp_path: Path, lm: Path) -> None:
    root = tmp_path
    (root / "shards").symlink_to(lm / "shards")
    save_hf(root / "llama", "llama", vocab_size=LM_VOCAB)
    train(root, root / "run", "train.max_steps=1")
    old = json.loads((root / "run" / "checkpoints" / "step-1" / "manifest.json").read_text())
    save_hf(root / "llama", "llama", vocab_size=LM_VOCAB, seed=1)  # other weights, same names
    with pytest.raises(ConfigError) as info:
        train(root, root / "run", "train.max_steps=2")
    message = str(info.value)
    digest = old["metadata"]["lora"]["base"]["digest"][:12]
    assert message.startswith(
        f"model.init_from={(root / 'llama').resolve()}: the base changed since the checkpoint "
        "of step 1 was trained on it: model.safetensors (other content)"
    )
    assert f"(digest then {digest}, now " in message and "\n" not in message
    assert "put that base's files back at this path" in message
    with pytest.raises(CheckpointError, match=r"a LoRA run whose base is unusable: .*changed"):
        read_model_weights_merged(root / "run")
    assert main(["eval", str(root / "run")]) == 4


def read_model_weights_merged(run_dir: Path) -> dict[str, torch.Tensor]:
    from hpctrain.models.lora_base import read_weights

    store, name, manifest = locate_checkpoint(str(run_dir))
    return read_weights(store, name, manifest)


def test_bf16_compute_on_a_bf16_base(lm: Path, tmp_path: Path) -> None:
    trainer = train(
        lm,
        tmp_path / "bf16",
        "train.max_steps=1",
        "train.precision=bf16",
        "model.lora.base_dtype=bf16",
        "data.val=",
    )
    wq = trainer.model.blocks[0].attention.wq
    assert wq.weight.dtype == torch.bfloat16 and wq.lora_A.weight.dtype == torch.float32
    assert wq.lora_B.weight.abs().sum() > 0
    # merged into the base as the run held it: its bf16 values (the frozen norm, exactly)
    from safetensors.torch import load_file

    out = tmp_path / "bf16.safetensors"
    assert main(["export", str(tmp_path / "bf16"), str(out)]) == 0
    held = trainer.model.norm.weight
    assert held.dtype == torch.bfloat16 and torch.equal(load_file(out)["norm.weight"], held.float())
    assert json.loads((tmp_path / "bf16.safetensors.json").read_text())["lora_base"] == "run (bf16)"


def test_qlora_trains_resumes_and_exports_merged(lm: Path, tmp_path: Path) -> None:
    pytest.importorskip("torchao")
    run_dir = tmp_path / "qlora"
    trainer = train(lm, run_dir, "train.max_steps=2", "model.lora.quantize_base=nf4", "data.val=")
    assert lora.is_nf4(trainer.model.blocks[0].attention.wq.weight)
    resumed = train(lm, run_dir, "train.max_steps=3", "model.lora.quantize_base=nf4", "data.val=")
    assert resumed.state.step == 3
    weights = read_model_weights_merged(run_dir)  # merged into the base's own (fp32) weights
    assert not any(lora.is_adapter(k) for k in weights)
    entries = read_model_weights(*locate_checkpoint(str(run_dir)))
    assert all(lora.is_adapter(k) for k in entries)


def test_qlora_is_evaluated_and_exported_on_the_base_it_trained_on(
    lm: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Training evaluates QLoRA on its NF4 base: `hpctrain eval` scores the same by default,
    the full-precision merge on request; exports merge into the NF4 base and say so."""
    pytest.importorskip("torchao")
    run_dir = tmp_path / "qlora"
    trainer = train(lm, run_dir, "train.max_steps=2", "model.lora.quantize_base=nf4")
    expected = logits(trainer.model)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    trained = [r for r in map(json.loads, lines) if r.get("kind") == "eval"][-1]["val_loss"]
    assert main(["eval", str(run_dir), "--out", str(tmp_path / "run.json")]) == 0
    record = json.loads((tmp_path / "run.json").read_text())
    assert record["val_loss"] == pytest.approx(trained, abs=1e-5)  # the run's own score
    assert record["lora_base"] == "run (nf4)"
    full_eval = ["eval", str(run_dir), "eval.lora_base=full", "--out", str(tmp_path / "f.json")]
    assert main(full_eval) == 0
    record = json.loads((tmp_path / "f.json").read_text())
    assert record["lora_base"] == "full"
    assert abs(record["val_loss"] - trained) > 1e-4  # another model: the full base
    capsys.readouterr()
    assert main(["export", str(run_dir), str(tmp_path / "merged"), "--format", "hf"]) == 0
    assert "adapters merged into the base as the run held it (nf4)" in capsys.readouterr().out
    config = json.loads((tmp_path / "merged" / "config.json").read_text())
    assert config["hpctrain_lora_base"] == "run (nf4)"
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").float()
    torch.testing.assert_close(logits(merged), expected, rtol=0, atol=1e-4)
    full = tmp_path / "full.safetensors"
    assert main(["export", str(run_dir), str(full), "--lora-base", "full"]) == 0
    assert "merged into the base's own weights (--lora-base full)" in capsys.readouterr().out
    assert json.loads((tmp_path / "full.safetensors.json").read_text())["lora_base"] == "full"
    assert main(["export", str(run_dir), str(tmp_path / "adapter"), "--format", "peft"]) == 0
    assert "trained these adapters on its base held in nf4" in capsys.readouterr().out


def test_a_vit_with_a_new_head_exports_merged_safetensors(
    shapes_shards: Path, tmp_path: Path
) -> None:
    from safetensors.torch import load_file

    from hpctrain.models import build_classifier

    torch.manual_seed(3)
    base = build_classifier("vit_tiny", 1000, 32).state_dict()  # as a download: 1,000 classes
    torch.save(base, tmp_path / "vit_tiny.pt")
    run_dir = tmp_path / "vit"
    cfg = load_config(
        None,
        [
            f"run_dir={run_dir}",
            "model.name=vit_tiny",
            "model.image_size=32",
            f"model.init_from={tmp_path / 'vit_tiny.pt'}",
            "model.lora.rank=2",
            f"data.train={shapes_shards / 'train' / 'index.json'}",
            "data.batch_size=4",
            "data.workers_per_rank=0",
            "train.max_steps=1",
            "train.precision=fp32",
            "train.strategy=none",
            "logging.progress=lines",
        ],
    )
    trainer = Trainer(cfg, SINGLE, torch.device("cpu"))
    assert trainer.adapted is not None
    assert trainer.adapted.trained_in_full == ("heads.head.bias", "heads.head.weight")
    assert trainer.fit() == 0
    out = tmp_path / "vit.safetensors"
    assert main(["export", str(run_dir), str(out)]) == 0
    model = build_classifier("vit_tiny", trainer.task.num_classes, 32)  # type: ignore[attr-defined]
    model.load_state_dict(load_file(out))
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval()(images), trainer.model.eval()(images), rtol=0, atol=1e-4
        )
    card = json.loads((tmp_path / "vit.safetensors.json").read_text())
    assert card["model"]["name"] == "vit_tiny"
