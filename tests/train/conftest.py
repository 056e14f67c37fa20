"""Shared fixtures for training tests (their shards, `shapes_shards`, are in tests/support/shard_fixtures.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest


@pytest.fixture(autouse=True)
def _restore_torch_globals() -> Iterator[None]:
    """In-process trainers switch on process-wide modes (deterministic algorithms)."""
    import torch

    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    torch.use_deterministic_algorithms(deterministic)
