"""LoRA on a built model (`hpctrain.models.lora`): which layers get adapters, what stays
frozen, the adapted forward and its merge, QLoRA's NF4 base, the base's fingerprint, and the
`model.lora.*` refusals, each one line naming the key. No training here: runs are in
tests/train/test_lora_runs.py, ranks in tests/parallel/test_lora_ranks.py."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from hpctrain.config import Config, ConfigError, load_config, with_overrides
from hpctrain.config.lora_rules import check_lora
from hpctrain.config.schema import LoraConfig
from hpctrain.models import build_classifier, lora, lora_base
from hpctrain.models.gpt import GPT, GPTConfig

SHAPE = GPTConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def tiny_gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(SHAPE)


def tokens() -> torch.Tensor:
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))


def test_the_gpt_default_adapts_every_projection_and_freezes_the_rest() -> None:
    model = tiny_gpt()
    names = {name for name, _ in model.named_parameters()}
    before = model(tokens())
    adapted = lora.apply_lora(model, LoraConfig(rank=4, alpha=8.0))
    assert len(adapted.modules) == 2 * 7  # wq wk wv wo w1 w2 w3 per block
    assert adapted.modules[:2] == ("blocks.0.attention.wq", "blocks.0.attention.wk")
    trained = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trained == {f"{m}.lora_{ab}.weight" for m in adapted.modules for ab in "AB"}
    # the base's names are unchanged (Hugging Face mapping, init_from, checkpoints)
    assert names <= {name for name, _ in model.named_parameters()}
    assert adapted.num_trainable == sum(
        p.numel() for n, p in model.named_parameters() if n in trained
    )
    assert "LoRA on 14 linear layers" in adapted.describe()
    with torch.no_grad():  # lora_B starts at zero: the model is still its base
        torch.testing.assert_close(model(tokens()), before, rtol=0, atol=0)


def test_the_adapted_layer_is_its_merge() -> None:
    model = tiny_gpt()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    lora.apply_lora(model, LoraConfig(rank=2, alpha=6.0, targets=["wq", "mlp.w2"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter(name):
                param.normal_(0, 0.5)
        trained = {k: v for k, v in model.state_dict().items() if lora.is_adapter(k)}
        merged = lora.merge_adapters(base, trained, 6.0 / 2)
        plain = tiny_gpt(seed=5)
        plain.load_state_dict(merged)
        torch.testing.assert_close(plain(tokens()), model(tokens()), rtol=0, atol=1e-5)
    assert sorted({lora.adapted_module(k) for k in trained}) == [
        "blocks.0.attention.wq",
        "blocks.0.mlp.w2",
        "blocks.1.attention.wq",
        "blocks.1.mlp.w2",
    ]


def test_targets_that_match_nothing_are_one_line_naming_valid_layers() -> None:
    with pytest.raises(ConfigError) as info:
        lora.apply_lora(tiny_gpt(), LoraConfig(rank=4, targets=["wq", "q_proj"]))
    message = str(info.value)
    assert message.startswith("model.lora.targets[1]='q_proj': matches no linear layer of GPT")
    assert "'blocks.0.attention.wq', 'blocks.0.attention.wk'" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"^model.lora.modules_to_save\[0\]='head': matches"):
        lora.apply_lora(tiny_gpt(), LoraConfig(rank=4, modules_to_save=["head"]))
    custom = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ConfigError, match=r"Sequential has no default: name the linear .*'0', '2'"):
        lora.apply_lora(custom, LoraConfig(rank=2))
    adapted = lora.apply_lora(custom, LoraConfig(rank=2, targets=["0"], modules_to_save=["2"]))
    assert adapted.modules == ("0",) and adapted.trained_in_full == ("2.bias", "2.weight")


def test_a_vit_adapts_its_mlp_not_the_attention_it_never_calls() -> None:
    model = build_classifier("vit_tiny", 3, 32)
    adapted = lora.apply_lora(
        model, LoraConfig(rank=2), fresh=["heads.head.weight", "heads.head.bias"]
    )
    assert len(adapted.modules) == 24 and all(
        m.endswith(("mlp.0", "mlp.3")) for m in adapted.modules
    )
    assert adapted.trained_in_full == ("heads.head.bias", "heads.head.weight")
    # nn.MultiheadAttention reads out_proj.weight itself: an adapter there would never run
    with pytest.raises(ConfigError, match=r"targets\[0\]='out_proj': matches no linear layer"):
        lora.apply_lora(
            build_classifier("vit_tiny", 3, 32), LoraConfig(rank=2, targets=["out_proj"])
        )


def test_a_bf16_base_keeps_fp32_adapters() -> None:
    model = tiny_gpt()
    lora.apply_lora(model, LoraConfig(rank=2, base_dtype="bf16"))
    dtypes = {p.dtype for n, p in model.named_parameters() if not lora.is_adapter(n)}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for n, p in model.named_parameters() if lora.is_adapter(n)} == {torch.float32}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert model(tokens()).shape == (2, 12, 64)


def test_qlora_holds_the_adapted_weights_in_nf4() -> None:
    pytest.importorskip("torchao")
    model = tiny_gpt()
    before = model(tokens()).detach()
    adapted = lora.apply_lora(model, LoraConfig(rank=2, quantize_base="nf4"))
    assert adapted.quantized
    wq = model.blocks[0].attention.wq
    assert lora.is_nf4(wq.weight) and not wq.weight.requires_grad
    out = model(tokens())
    # 4-bit weights: close to the base, not equal
    assert 0 < (out - before).abs().max() < 0.5 * before.abs().max()
    out.sum().backward()  # gradients reach the adapters through the dequantized base
    assert wq.lora_B.weight.grad is not None and wq.weight.grad is None


def test_qlora_without_a_backend_is_refused_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torchao", None)  # as where torchao is not installed
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(
        ConfigError, match=r"^model.lora.quantize_base=nf4: no NF4 backend runs here"
    ):
        lora.apply_lora(tiny_gpt(), LoraConfig(rank=2, quantize_base="nf4"))


def test_initial_adapters_do_not_depend_on_the_global_seed() -> None:
    first, second = tiny_gpt(0), tiny_gpt(1)
    for model in (first, second):
        lora.apply_lora(model, LoraConfig(rank=2))
    a, b = lora.initial_adapters(first, seed=3), lora.initial_adapters(second, seed=3)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(not v.any() for k, v in a.items() if ".lora_B." in k)
    lora.set_adapters(first, a)
    with pytest.raises(ConfigError, match=r"missing: 'blocks.0.attention.wk.lora_A.weight'"):
        lora.set_adapters(first, {k: v for k, v in a.items() if "attention.wk.lora_A" not in k})


def test_the_fingerprint_follows_the_weights_not_the_folder_name(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    first = tmp_path / "base.safetensors"
    save_file({"w": torch.ones(300, 300)}, first)
    print_one = lora_base.fingerprint(str(first))
    moved = tmp_path / "copy.safetensors"
    moved.write_bytes(first.read_bytes())
    assert lora_base.fingerprint(str(moved))["digest"] != print_one["digest"]  # the name counts
    save_file({"w": torch.ones(300, 300) * 2}, first)  # same header, other weights
    again = lora_base.fingerprint(str(first))
    assert again["digest"] != print_one["digest"] and again["path"] == print_one["path"]
    with pytest.raises(ConfigError, match=r"not the base the checkpoint of step 4 was trained on"):
        lora_base.check_same_base({**print_one, "path": str(moved)}, again, 4)


def save_base(folder: Path) -> tuple[Path, int]:
    """A Hugging Face-like folder whose model.safetensors (4.5 MiB) holds `embed`, `layer`
    and `norm`, in that order: `layer` lies between the first and the last MiB. Returns the
    file and the offset of `layer`'s bytes."""
    import json

    from safetensors.torch import save_file

    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    tensors = {
        "embed": torch.ones(512, 768),
        "layer": torch.arange(512 * 512, dtype=torch.float32).reshape(512, 512),
        "norm": torch.ones(512, 768),
    }
    file = folder / "model.safetensors"
    save_file(tensors, file)
    header = int.from_bytes(file.read_bytes()[:8], "little")
    offsets = json.loads(file.read_bytes()[8 : 8 + header])["layer"]["data_offsets"]
    return file, 8 + header + offsets[0]


def rewrite_in_place(file: Path, offset: int, data: bytes) -> None:
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_tensor_rewritten_in_the_middle_of_a_file_changes_the_fingerprint(
    tmp_path: Path,
) -> None:
    file, layer = save_base(tmp_path / "base")
    before = lora_base.fingerprint(str(tmp_path / "base"))
    stat = file.stat()
    # a few rows of `layer` rewritten in place: same size, same header
    rewrite_in_place(file, layer + 512 * 4 * 100, torch.zeros(512 * 8).numpy().tobytes())
    os.utime(file, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # even with its mtime set back
    assert file.stat().st_size == stat.st_size
    after = lora_base.fingerprint(str(tmp_path / "base"), known=before)
    assert after["digest"] != before["digest"]
    with pytest.raises(ConfigError) as info:
        lora_base.check_same_base(before, after, 7)
    message = str(info.value)
    assert message.startswith(f"model.init_from={(tmp_path / 'base').resolve()}: the base changed")
    assert "model.safetensors (other content)" in message and "step 7" in message
    assert "set model.init_from back" not in message and "\n" not in message


def test_an_unchanged_base_is_checked_by_its_files_records_without_reading_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from hpctrain.models import lora_fingerprint

    monkeypatch.setattr(lora_fingerprint, "RECENT_S", 0.0)  # files written a moment ago
    file, _ = save_base(tmp_path / "base")
    first = lora_base.fingerprint(str(tmp_path / "base"))
    assert set(first["files"]) == {"model.safetensors", "config.json"}
    hashed: list[str] = []
    real = lora_fingerprint.hash_file
    monkeypatch.setattr(lora_fingerprint, "hash_file", lambda f: hashed.append(f.name) or real(f))
    again = lora_base.fingerprint(str(tmp_path / "base"), known=first)
    assert again == first and hashed == []  # size, mtime, ctime and inode: nothing read
    copy = tmp_path / "copy"
    copy.mkdir()
    for name in ("config.json", "model.safetensors"):
        (copy / name).write_bytes((tmp_path / "base" / name).read_bytes())
    moved = lora_base.fingerprint(str(copy), known=first)  # elsewhere: hashed, same digest
    assert moved["digest"] == first["digest"] and len(hashed) == 2
    os.utime(file)  # touched, not changed: hashed again, the same base
    touched = lora_base.fingerprint(str(tmp_path / "base"), known=first)
    assert touched["digest"] == first["digest"] and hashed[2:] == ["model.safetensors"]
    lora_base.check_same_base(first, touched, 1)
    # a checkpoint of an older hpctrain: its digest of each file's first and last MiB
    old = {"path": first["path"], "kind": "hf", "ema": False}
    lora_base.check_same_base(
        {**old, "digest": lora_fingerprint.legacy_digest(first["path"])}, touched, 1
    )
    with pytest.raises(ConfigError, match="the base changed since"):
        lora_base.check_same_base({**old, "digest": "0" * 64}, touched, 1)


def test_the_peft_adapter_names_its_base_by_its_hub_name_where_known(tmp_path: Path) -> None:
    """adapter_config.json's base_model_name_or_path: a Hub cache snapshot gives the Hub
    name and revision; else the path the run read (an absolute path of the training machine),
    also where config.json names another model (a fine-tune names its own base there)."""
    import json

    from hpctrain.models.lora_peft import peft_adapter

    def config_for(path: Path) -> dict:
        entry = {"base": {"path": str(path)}, "rank": 4, "alpha": 8, "modules": []}
        return peft_adapter({}, entry, None, "causal_lm")[0]

    snapshot = tmp_path / "hub" / "models--meta-llama--Llama-3.2-1B" / "snapshots" / "4e20de3"
    snapshot.mkdir(parents=True)
    config = config_for(snapshot)
    assert config["base_model_name_or_path"] == "meta-llama/Llama-3.2-1B"
    assert config["revision"] == "4e20de3"
    plain = tmp_path / "llama"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"_name_or_path": "Qwen/Qwen2-0.5B"}))
    config = config_for(plain)
    assert config["base_model_name_or_path"] == str(plain) and config["revision"] is None


def lora_config(*overrides: str) -> Config:
    return load_config(None, ["model.init_from=/base", *overrides])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["model.lora.init_from=/adapter"],
            r"^model.lora.init_from='/adapter': needs model.lora.rank > 0",
        ),
        (
            ["model.lora.quantize_base=nf4"],
            r"^model.lora.quantize_base='nf4': needs model.lora.rank",
        ),
        (["model.lora.rank=8", "model.init_from="], r"^model.lora.rank=8: needs model.init_from"),
        (
            ["model.lora.rank=8", "model.lora.base_dtype=bf16", "train.precision=fp32"],
            r"^model.lora.base_dtype=bf16: the base is held in the compute dtype",
        ),
        (
            ["model.lora.rank=8", "train.tp_degree=2", "train.strategy=fsdp"],
            r"^train.tp_degree=2 with model.lora.rank=8: LoRA adapters are not split",
        ),
    ],
    ids=["adapters-without-rank", "nf4-without-rank", "no-base", "bf16-base-fp32", "tp"],
)
def test_settings_that_cannot_train_are_refused(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message) as info:
        check_lora(lora_config(*overrides))
    assert "\n" not in str(info.value)


def test_bad_values_are_refused_at_load() -> None:
    with pytest.raises(ConfigError, match=r"model.lora.rank=-1 \(command line\): must be >= 0"):
        lora_config("model.lora.rank=-1")
    with pytest.raises(ConfigError, match=r"model.lora.alpha=0.0 \(command line\): must be > 0"):
        lora_config("model.lora.alpha=0")
    with pytest.raises(ConfigError, match=r"model.lora.quantize_base='int4'.*none\|nf4"):
        lora_config("model.lora.quantize_base=int4")
    check_lora(
        with_overrides(
            lora_config(),
            ["model.lora.rank=8", "train.precision=bf16", "model.lora.base_dtype=bf16"],
        )
    )


@pytest.mark.slow  # torch.compile's import and tracing: ~20 s here
def test_an_adapted_block_compiles_whole_and_trains() -> None:
    """`train.compile` compiles each block; on a CPU without a C++ compiler inductor cannot
    run, so the graph is captured with a backend that needs none: no graph break (fullgraph)
    and the same values as eager."""
    model = tiny_gpt()
    lora.apply_lora(model, LoraConfig(rank=2, dropout=0.0))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.1)
    expected = model(tokens())
    for i, block in enumerate(model.blocks):
        model.blocks[i] = torch.compile(block, backend="aot_eager", fullgraph=True)
    out = model(tokens())
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
    out.sum().backward()
    assert model.blocks[0].attention.wq.lora_A.weight.grad is not None


def test_preflight_refuses_a_lora_job_on_the_login_node() -> None:
    from hpctrain.launch.preflight import check_lora_settings

    assert check_lora_settings(Config()) is None
    ok = check_lora_settings(lora_config("model.lora.rank=8"))
    assert ok is not None and ok.ok and ok.message == "rank 8, alpha 16 on /base"
    failed = check_lora_settings(lora_config("model.lora.rank=8", "train.tp_degree=2"))
    assert failed is not None and not failed.ok and "train.tp_degree=2" in failed.message


def test_freeze_and_lr_groups_apply_to_the_adapters() -> None:
    from hpctrain.train.optim import build_optimizer, freeze_parameters

    model = tiny_gpt()
    adapted = lora.apply_lora(model, LoraConfig(rank=2))
    trainable, frozen = freeze_parameters(model, ["*.wq.lora_A.*"])
    assert trainable == adapted.num_trainable - 2 * 2 * 32  # two blocks' wq lora_A (2 x 32)
    assert frozen == adapted.num_total - trainable
    cfg = load_config(
        None, ["train.lr=0.001", "train.lr_groups=[{pattern: '*.lora_B.*', lr_scale: 4}]"]
    )
    optimizer = build_optimizer(model, cfg.train)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [(g["lr"], sorted(names[id(p)] for p in g["params"])) for g in optimizer.param_groups]
    assert [lr for lr, _ in groups] == [0.001, 0.004]
    assert all(".lora_A." in n and ".wq." not in n for n in groups[0][1])
    assert all(".lora_B." in n for n in groups[1][1]) and len(groups[1][1]) == 14
    # the frozen base is in no group
    assert not any(n for _, ns in groups for n in ns if not lora.is_adapter(n))
