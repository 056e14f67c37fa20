"""`models/deferred_init.py` in one process: a model built on the meta device and replayed
into fresh storage holds bitwise the values of a CPU build from the same seed, and leaves the
random stream where the CPU build leaves it; what cannot be replayed is built whole. The
sharded path (FSDP2, HSDP, 2 ranks) is tests/parallel/test_fsdp_memory.py."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torchvision
from torch import nn

from hpctrain.models.deferred_init import build_on_meta
from hpctrain.models.gpt import GPT, gpt_config
from hpctrain.models.small_cnn import SmallCNN

BUILDS: dict[str, Callable[[], nn.Module]] = {
    "gpt": lambda: GPT(gpt_config("gpt-tiny", 300)),
    "resnet18": lambda: torchvision.models.resnet18(num_classes=10),  # kaiming_normal_, BN
    "small_cnn": lambda: SmallCNN(10),
}


@pytest.mark.parametrize("name", sorted(BUILDS))
def test_a_replayed_meta_build_is_the_cpu_build(name: str) -> None:
    build = BUILDS[name]
    torch.manual_seed(0)
    reference = build().state_dict()
    stream_after = torch.get_rng_state()
    torch.manual_seed(0)
    model, recording = build_on_meta(build)
    assert recording is not None and all(p.is_meta for p in model.parameters())
    assert torch.equal(torch.get_rng_state(), stream_after)  # later draws are the same too
    model.to_empty(device="cpu")
    recording.materialize(model)
    values = model.state_dict()
    assert values.keys() == reference.keys()
    for key, tensor in reference.items():
        assert torch.equal(values[key], tensor), key
    assert torch.equal(torch.get_rng_state(), stream_after)  # replaying draws nothing new


class ConstantBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        self.register_buffer("mean", torch.tensor([0.485, 0.456, 0.406]))


class TruncatedNormal(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 2)
        nn.init.trunc_normal_(self.linear.weight, std=0.02)  # a no-op on the meta device


@pytest.mark.parametrize("build", [ConstantBuffer, TruncatedNormal])
def test_what_cannot_be_replayed_is_built_whole(build: Callable[[], nn.Module]) -> None:
    torch.manual_seed(0)
    reference = build().state_dict()
    torch.manual_seed(0)
    model, recording = build_on_meta(build)
    assert recording is None and not any(p.is_meta for p in model.parameters())
    for key, tensor in reference.items():
        assert torch.equal(model.state_dict()[key], tensor), key
    assert nn.init.trunc_normal_.__name__ == "trunc_normal_"  # torch's own, restored
