"""Under FSDP2 a Hugging Face import builds the model on the meta device and each rank reads
its own rows: the same weights, EMA and logits as building the whole model first."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hpctrain.config import Config, ConfigError, with_overrides
from hpctrain.models import init_from
from tests.models.test_hf import LM_VOCAB, save_hf
from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import REPO, run_two_ranks

pytest.importorskip("transformers")


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("precision", "strategy"),
    [("fp32", "fsdp"), ("bf16", "fsdp"), ("fp32", "hsdp"), ("bf16", "fsdp-tp")],
)
def test_meta_build_loads_what_a_whole_build_loads(
    tmp_path: Path, precision: str, strategy: str
) -> None:
    folder = tmp_path / "llama"
    reference = save_hf(folder, "llama", vocab_size=LM_VOCAB, tie_word_embeddings=False)
    if precision == "bf16":  # a bf16 file into fp32 shards: read through one buffer
        reference.to(torch.bfloat16).save_pretrained(folder)
    write_token_shards(tmp_path / "shards" / "train", 1, seed=1)
    write_token_shards(tmp_path / "shards" / "val", 1, seed=2)
    worker = REPO / "tests" / "support" / "meta_worker.py"
    outputs = run_two_ranks(
        worker,
        str(folder),
        str(tmp_path / "shards"),
        str(tmp_path),
        precision,
        strategy,
        timeout=300,
    )
    assert all("equal" in output for output in outputs), outputs


def test_only_fsdp2_with_a_hugging_face_folder_builds_on_meta(tmp_path: Path) -> None:
    save_hf(tmp_path / "llama", "llama")
    torch.save({}, tmp_path / "w.pt")
    hf_cfg = with_overrides(Config(), [f"model.init_from={tmp_path / 'llama'}"])
    file_cfg = with_overrides(Config(), [f"model.init_from={tmp_path / 'w.pt'}"])
    assert init_from.builds_on_meta(hf_cfg, "fsdp")
    assert init_from.builds_on_meta(hf_cfg, "hsdp")
    assert not init_from.builds_on_meta(hf_cfg, "ddp")
    assert not init_from.builds_on_meta(hf_cfg, "none")
    assert not init_from.builds_on_meta(file_cfg, "fsdp")
    assert not init_from.builds_on_meta(Config(), "fsdp")


def test_rows_are_read_straight_or_converted_and_a_truncated_file_is_named(
    tmp_path: Path,
) -> None:
    from safetensors.torch import save_file

    from hpctrain.models import hf

    weights = torch.arange(5 * 3, dtype=torch.float32).reshape(5, 3)
    save_file({"w": weights, "b": weights.to(torch.bfloat16)}, str(tmp_path / "m.safetensors"))
    data_start, entries = hf.read_header(tmp_path / "m.safetensors")
    assert set(entries) == {"w", "b"}
    with open(tmp_path / "m.safetensors", "rb") as f:
        straight = torch.empty(2, 3)  # the file's dtype: read into it
        hf.read_rows(f, data_start, entries["w"], 3, straight)
        converted = torch.empty(2, 3)  # bf16 in the file: through a buffer
        hf.read_rows(f, data_start, entries["b"], 1, converted)
    assert torch.equal(straight, weights[3:5]) and torch.equal(converted, weights[1:3])
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-8])
    last = max(entries, key=lambda name: entries[name]["data_offsets"][1])
    with (
        open(tmp_path / "m.safetensors", "rb") as f,
        pytest.raises(ConfigError, match=r"m.safetensors ends inside its tensors"),
    ):
        hf.read_rows(f, data_start, entries[last], 4, torch.empty(1, 3))
