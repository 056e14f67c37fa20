"""The compact index forced on tests written for index.json (`tests/data/test_compact_forced*.py`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.data import locate
from hpctrain.data.compact import CompactShards
from hpctrain.data.node_index import FORM_ENV, NODE_LOCAL_ENV


@pytest.fixture(scope="module", autouse=True)
def compact_forced(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Before the module's fixtures build shards (autouse: set up first in its scope)."""
    node = tmp_path_factory.mktemp("node-local")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(FORM_ENV, "compact")
        mp.setenv(NODE_LOCAL_ENV, str(node))
        yield node
    copies = list(node.glob("hpctrain-index-*/*.compact"))
    assert copies, "no index was read in the compact form"


@pytest.fixture(autouse=True)
def every_index_is_compact(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Every index opened in this process comes from its companion."""
    opened = []
    load = locate.load_index

    def spy(*args, **kwargs):
        index = load(*args, **kwargs)
        opened.append(index.shards)
        return index

    monkeypatch.setattr(locate, "load_index", spy)
    yield
    assert all(isinstance(s, CompactShards) for s in opened), [type(s) for s in opened]
