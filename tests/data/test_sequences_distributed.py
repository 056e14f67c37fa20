"""Packed sequences on 2 gloo ranks x 2 workers: equal batch counts (a collective per batch),
every sequence's ids exact, each sequence seen once over both ranks."""

from __future__ import annotations

import datetime
import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, open_index
from hpctrain.launch.local import free_port
from tests.support.token_kit import (
    SEQ_LEN,
    all_sequence_keys,
    positions_window,
    window,
    write_token_shards,
)

pytestmark = [pytest.mark.distributed, pytest.mark.slow]


def rank_main(rank: int, world_size: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),  # a rank left short fails here, not forever
    )
    streams = json.loads(Path(root, "streams.json").read_text())
    # remainder pad: every sequence once (valid), the repeats that even out the ranks flagged
    cfg = DataConfig(
        seq_len=SEQ_LEN, batch_size=2, workers_per_rank=2, shuffle_buffer=3, remainder="pad"
    )
    loader = ShardedLoader(open_index(root), cfg, rank=rank, world_size=world_size, seed=4)
    keys, wrong, steps = [], 0, 0
    for batch in loader:
        dist.all_reduce(torch.ones(1))  # unequal batch counts would hang here
        steps += 1
        rows = zip(batch["key"], batch["valid"], batch["tokens"], batch["positions"], strict=True)
        for key, ok, row, positions in rows:
            wrong += row.tolist() != window(streams, key)
            wrong += positions.tolist() != positions_window(streams, key)
            if ok:
                keys.append(key)
    loader.close()
    results = {"steps": steps, "len": len(loader), "keys": keys, "wrong": wrong}
    Path(root, f"rank-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def test_packed_sequences_on_two_ranks(tmp_path):
    streams = write_token_shards(tmp_path)
    (tmp_path / "streams.json").write_text(json.dumps(streams))
    mp.spawn(rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    a, b = (json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2))
    assert a["steps"] == b["steps"] == a["len"] == b["len"] > 0
    assert a["wrong"] == b["wrong"] == 0  # every row holds its key's window, fillers too
    assert Counter(a["keys"] + b["keys"]) == Counter(all_sequence_keys(streams))
