"""Multi-field samples on 2 gloo ranks x 2 workers: every field exact on every rank, each
sample once; then the 2-rank state resumed on 1 rank sees the rest exactly once."""

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
from tests.support.sample_kit import field_mismatches, multi_key, write_multi_field_shards

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SIZES = [9, 4, 11, 8]  # 32 samples
STOP = 2  # batches each rank takes before its state is saved


def data_cfg() -> DataConfig:
    return DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=3)


def rank_main(rank: int, world_size: int, port: int, root: str) -> None:
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=60),
    )
    index = open_index(root)
    full = ShardedLoader(index, data_cfg(), rank=rank, world_size=world_size, seed=3)
    keys, wrong, steps = [], [], 0
    for batch in full:
        dist.all_reduce(torch.ones(1))  # unequal batch counts would hang here
        steps += 1
        keys += [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]
        wrong += field_mismatches(batch)
    full.close()
    partial = ShardedLoader(index, data_cfg(), rank=rank, world_size=world_size, seed=3)
    partial.set_epoch(1)
    it = iter(partial)
    first = []
    for _ in range(STOP):
        batch = next(it)
        first += [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]
    state = partial.state_dict()
    partial.close()
    result = {"steps": steps, "len": len(full), "keys": keys, "wrong": wrong, "first": first}
    Path(root, f"rank-{rank}.json").write_text(json.dumps({**result, "state": state}))
    dist.barrier()
    dist.destroy_process_group()


def test_multi_field_samples_on_two_ranks_then_resumed_on_one(tmp_path):
    write_multi_field_shards(tmp_path, SIZES)
    mp.spawn(rank_main, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    a, b = ranks
    assert a["steps"] == b["steps"] == a["len"] == b["len"] == 8
    assert a["wrong"] == b["wrong"] == []
    every = {multi_key(s, i) for s, n in enumerate(SIZES) for i in range(n)}
    assert Counter(a["keys"] + b["keys"]) == Counter(every)  # disjoint, complete
    assert a["state"] == b["state"]
    resumed = ShardedLoader(open_index(str(tmp_path)), data_cfg(), rank=0, world_size=1, seed=3)
    resumed.load_state_dict(a["state"])
    rest = []
    for batch in resumed:
        assert not field_mismatches(batch)
        rest += [k for k, ok in zip(batch["key"], batch["valid"].tolist(), strict=True) if ok]
    resumed.close()
    assert Counter(a["first"] + b["first"] + rest) == Counter(every)
