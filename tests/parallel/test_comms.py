"""The network model behind docs/training.md's strategy table (`hpctrain.parallel.comms`)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from hpctrain.parallel.comms import traffic

REPO = Path(__file__).resolve().parents[2]
P = 1_000_000


def test_one_node_sends_nothing_over_the_network() -> None:
    for strategy in ("ddp", "fsdp", "hsdp"):
        assert traffic(strategy, P, 5, nodes=1, gpus_per_node=8).network_bytes_per_node == 0


def test_ring_volumes_per_node() -> None:
    # 2 nodes x 4: DDP all-reduces fp32 gradients over 8 ranks: 2 * 7/8 * 4 bytes
    assert traffic("ddp", P, 5, 2, 4).network_bytes_per_node == pytest.approx(7 * P)
    # FSDP2: two bf16 all-gathers and an fp32 reduce-scatter over 8 ranks: 7/8 * 8 bytes
    fsdp = traffic("fsdp", P, 5, 2, 4)
    assert fsdp.network_bytes_per_node == pytest.approx(7 * P)
    assert fsdp.cross_node_collectives == 15 and fsdp.state_bytes_per_gpu == 2 * P
    # HSDP: the gathers stay in the node; 2 replicas all-reduce the gradients: 2 * 1/2 * 4
    hsdp = traffic("hsdp", P, 5, 2, 4)
    assert hsdp.network_bytes_per_node == pytest.approx(4 * P)
    assert hsdp.cross_node_collectives == 5 and hsdp.state_bytes_per_gpu == 4 * P


def test_shard_groups_larger_than_a_node_gather_across_nodes() -> None:
    wide = traffic("hsdp", P, 5, nodes=4, gpus_per_node=4, shard_degree=8)
    narrow = traffic("hsdp", P, 5, nodes=4, gpus_per_node=4)
    assert wide.cross_node_collectives == 5 + 15 > narrow.cross_node_collectives
    assert wide.state_bytes_per_gpu == narrow.state_bytes_per_gpu / 2
    with pytest.raises(ValueError, match="shard degree 3"):
        traffic("hsdp", P, 5, nodes=2, gpus_per_node=4, shard_degree=3)
    with pytest.raises(ValueError, match="expected ddp, fsdp or hsdp"):
        traffic("tp", P, 5, 2, 4)


def test_the_strategy_table_in_the_docs_is_current() -> None:
    sys.path.insert(0, str(REPO / "tools"))
    from comms_table import PAGE, render

    page = PAGE.read_text(encoding="utf-8")
    assert render(page) == page, "docs/training.md's strategy table is stale: run make docs"
