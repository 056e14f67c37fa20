"""The default collate and a Task collate's packing, on plain memory (no processes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hpctrain.data.buffers import PlainMemory
from hpctrain.data.collate import BatchError, Collator, pack_batch


def collate(samples: list[dict], valid: list[bool] | None = None) -> dict:
    keys = [s["key"] for s in samples]
    collator = Collator(samples[0], keys[0], len(samples), PlainMemory())
    for pos, sample in enumerate(samples):
        collator.put(pos, sample, keys[pos])
    return collator.finish(keys, valid or [True] * len(samples), {"_extra": 1})


def sample(i: int, **over) -> dict:
    base = {
        "key": f"k{i}",
        "image": torch.full((3, 2, 2), i, dtype=torch.uint8),
        "depth": np.full((2, 2), i / 2, dtype=np.float32),
        "label": i,
        "score": float(i),
        "ok": i % 2 == 0,
        "text": f"t{i}",
        "meta": {"i": i},
        "raw": bytes([i]),
        "none": None,
    }
    base.update(over)
    return base


def test_tensors_and_arrays_stack_scalars_become_tensors_the_rest_lists():
    batch = collate([sample(0), sample(1), sample(2)], valid=[True, False, True])
    assert torch.equal(batch["image"][:, 0, 0, 0], torch.tensor([0, 1, 2], dtype=torch.uint8))
    assert batch["depth"].dtype == torch.float32 and batch["depth"][:, 0, 0].tolist() == [0, 0.5, 1]
    assert batch["label"].dtype == torch.int64 and batch["label"].tolist() == [0, 1, 2]
    assert batch["score"].dtype == torch.float64 and batch["ok"].dtype == torch.bool
    assert batch["ok"].tolist() == [True, False, True]
    assert batch["text"] == ["t0", "t1", "t2"] and batch["meta"] == [{"i": 0}, {"i": 1}, {"i": 2}]
    assert batch["raw"] == [b"\0", b"\1", b"\2"] and batch["none"] == [None] * 3
    assert batch["key"] == ["k0", "k1", "k2"] and batch["valid"].tolist() == [True, False, True]
    assert batch["_extra"] == 1


def test_ints_in_a_float_field_are_taken_other_type_changes_are_not():
    assert collate([sample(0, score=1.5), sample(1, score=2)])["score"].tolist() == [1.5, 2.0]
    with pytest.raises(BatchError, match="field 'label' differs.*int in sample 'k0', float in"):
        collate([sample(0), sample(1, label=1.0)])
    with pytest.raises(BatchError, match="field 'image' differs.*str in sample 'k1'"):
        collate([sample(0), sample(1, image="no")])


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (
            {"image": torch.zeros(3, 4, 4, dtype=torch.uint8)},
            r"field 'image' differs within a batch: \[3, 2, 2\] torch.uint8 in sample 'k0', "
            r"\[3, 4, 4\] torch.uint8 in sample 'k1'",
        ),
        (
            {"image": torch.zeros(3, 2, 2, dtype=torch.float32)},
            r"\[3, 2, 2\] torch.uint8 in sample 'k0', \[3, 2, 2\] torch.float32 in sample 'k1'",
        ),
    ],
)
def test_shape_or_dtype_mismatch_names_field_key_and_both(bad, message):
    with pytest.raises(BatchError, match=message):
        collate([sample(0), sample(1, **bad)])


def test_missing_and_extra_fields_name_field_and_key():
    lacking = sample(1)
    del lacking["text"]
    with pytest.raises(BatchError, match="sample 'k1' has no field 'text'"):
        collate([sample(0), lacking])
    with pytest.raises(BatchError, match="field 'new' of sample 'k1' is not in sample 'k0'"):
        collate([sample(0), sample(1, new=3)])


def test_loader_fields_in_samples_are_not_collated():
    batch = collate([sample(0, valid="x"), sample(1, valid="y")], valid=[True, True])
    assert batch["valid"].tolist() == [True, True]


def test_a_task_collates_batch_is_packed_with_key_and_valid():
    made = {"tokens": torch.arange(6).view(2, 3), "mask": np.ones((2, 3), bool), "ids": [1, 2]}
    batch = pack_batch(made, ["a", "b"], [True, False], PlainMemory(), {"_stats": [0]})
    assert torch.equal(batch["tokens"], made["tokens"]) and batch["mask"].dtype == torch.bool
    assert batch["ids"] == [1, 2] and batch["key"] == ["a", "b"]
    assert batch["valid"].tolist() == [True, False] and batch["_stats"] == [0]
    with pytest.raises(TypeError, match="must return a dict"):
        pack_batch([1], ["a"], [True], PlainMemory(), {})  # type: ignore[arg-type]
