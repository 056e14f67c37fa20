"""A mixture through the trainer: per-source `samples_seen/<name>` in the train records and
the sample log's per-source exposure as planned (one process, tiny MLP)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from tests.train.test_trainer import build, make_config, read_jsonl, train_records


def test_mixture_trains_with_per_source_counts_and_sample_log(
    shapes_shards: Path, tmp_path: Path
) -> None:
    curated, web = shapes_shards / "train", shapes_shards / "val"
    cfg = make_config(
        shapes_shards,
        tmp_path,
        "data.val=",
        "data.sample_log=true",
        "data.batch_size=32",
        "train.max_steps=0",
        "train.max_epochs=1",
        "train.log_every=100",
        f"data.train=[{{path: {curated}, weight: 0.7, name: curated}}, {{path: {web}, weight: 0.3}}]",
    )
    trainer = build(cfg)
    mixture = trainer.loader.mixture
    assert mixture is not None and mixture.names == ("curated", "val")
    owner = mixture.source_of_shard()
    planned = Counter(
        mixture.names[owner[s]] for s, _, ok in trainer.loader.plan().rank_order(0) if ok
    )
    assert trainer.fit() == 0
    last = train_records(tmp_path)[-1]
    assert {n: last[f"samples_seen/{n}"] for n in mixture.names} == dict(planned)
    assert last["samples_seen/curated"] + last["samples_seen/val"] == last["samples_seen"]
    logged = [k for line in read_jsonl(tmp_path / "samples" / "rank-0.jsonl") for k in line["keys"]]
    assert len(logged) == sum(planned.values())
    # the small source (80 samples for ~120 slots) repeats within the epoch, pass by pass
    counts = Counter(logged)
    assert max(counts.values()) == 2 and len(counts) < len(logged)
