"""2 ranks x 2 workers over gloo on real shards: disjoint keys, nothing missing, no hang."""

from __future__ import annotations

import datetime
import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hpctrain.config.schema import DataConfig
from hpctrain.data import ShardedLoader, open_index
from hpctrain.launch.local import free_port
from tests.support.loader_kit import all_keys, make_shards

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

# name -> (shard sizes, batch size, train)
SCENARIOS = {
    "uneven": ([3, 17, 8, 1, 11], 3, True),  # 5 shards of different sizes
    "fewer_shards_than_workers": ([5, 4], 2, True),  # 2 shards, 4 streams
    "eval_pad": ([3, 17, 8, 1, 11], 4, False),
}


def rank_main(rank: int, world_size: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),  # a rank left short fails here, not forever
    )
    results = {}
    for name, (_sizes, batch_size, train) in SCENARIOS.items():
        index = open_index(str(Path(root) / name))
        cfg = DataConfig(batch_size=batch_size, workers_per_rank=2, shuffle_buffer=4)
        loader = ShardedLoader(index, cfg, rank=rank, world_size=world_size, seed=7, train=train)
        keys, valid_keys, steps = [], [], 0
        for batch in loader:
            # a collective per batch, as DDP does: unequal batch counts would hang here
            dist.all_reduce(torch.ones(1))
            steps += 1
            keys += batch["key"]
            valid_keys += [k for k, ok in zip(batch["key"], batch["valid"], strict=True) if ok]
        results[name] = {"steps": steps, "len": len(loader), "keys": keys, "valid": valid_keys}
    Path(root, f"rank-{rank}.json").write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_two_workers_gloo(tmp_path):
    for name, (sizes, _b, _t) in SCENARIOS.items():
        make_shards(tmp_path / name, sizes)
    mp.spawn(rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    for name, (sizes, batch_size, train) in SCENARIOS.items():
        a, b = ranks[0][name], ranks[1][name]
        assert a["steps"] == b["steps"] == a["len"] == b["len"], name
        assert not set(a["valid"]) & set(b["valid"]), name  # disjoint across ranks
        total = sum(sizes)
        if train:
            kept = a["steps"] * 2 * batch_size
            assert a["steps"] == total // (2 * batch_size)
            assert len(set(a["keys"]) | set(b["keys"])) == kept  # no repeats anywhere
            assert set(a["keys"]) | set(b["keys"]) <= all_keys(sizes)
        else:
            assert sorted(a["valid"] + b["valid"]) == sorted(all_keys(sizes))  # all, once
