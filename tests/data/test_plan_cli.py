"""`hpctrain plan`: text and JSON output on real shards, errors naming the data."""

from __future__ import annotations

import json
from collections import Counter

from hpctrain.cli.main import main
from tests.support.loader_kit import make_shards


def test_plan_json_lists_every_stream(tmp_path, capsys):
    make_shards(tmp_path, [5, 9, 2, 7])
    code = main(
        [
            "plan",
            str(tmp_path / "train-{000000..000003}.tar"),
            "--world-size",
            "2",
            "--workers-per-rank",
            "2",
            "--batch-size",
            "3",
            "--json",
        ]
    )
    assert code == 0
    out = json.loads(capsys.readouterr().out)
    assert out["batches_per_rank"] == 23 // 6 and out["num_dropped"] == 23 - 18
    assert len(out["stream_segments"]) == 4
    read = sum(e - s for st in out["stream_segments"] for _u, s, e, _v in st["segments"])
    assert read == 18


def test_plan_text_and_rank_detail(tmp_path, capsys):
    make_shards(tmp_path, [4, 4, 4])
    assert (
        main(
            [
                "plan",
                str(tmp_path),
                "--world-size",
                "5",
                "--workers-per-rank",
                "1",
                "--batch-size",
                "2",
                "--remainder",
                "pad",
                "--rank",
                "4",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "2 batches per rank" in out and "8 padded" in out
    assert "rank 4 worker 0: 2 batches:" in out and "(pad)" in out


def test_plan_missing_index_names_it(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nowhere"), "--world-size", "1", "--batch-size", "1"]) == 3
    assert "nowhere/index.json: index not found" in capsys.readouterr().err


def test_plan_of_a_mixture_prints_the_realized_mixture_per_rank(tmp_path, capsys):
    make_shards(tmp_path / "a", [6, 9, 5])
    make_shards(tmp_path / "b", [4], prefix="b")
    argv = [
        "plan",
        str(tmp_path / "a"),
        str(tmp_path / "b"),
        "--weights",
        "3,1",
        "--samples-per-epoch",
        "40",
        "--world-size",
        "2",
        "--workers-per-rank",
        "2",
        "--batch-size",
        "4",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "a: weight 0.750, 30 samples this epoch of 20 (passes 0-1)" in out
    assert "b: weight 0.250, 10 samples this epoch of 4 (passes 0-2)" in out
    assert "rank 0: a 15, b 5" in out and "rank 1: a 15, b 5" in out
    assert main([*argv, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["per_rank_samples"] == [[15, 5], [15, 5]]
    read = Counter()
    for stream in data["stream_segments"]:
        for url, start, end, _valid in stream["segments"]:
            read["b" if "/b/" in url else "a"] += end - start
    assert read == {"a": 30, "b": 10}
    assert main([*argv[:3], "--world-size", "1", "--batch-size", "1", "--weights", "1"]) == 2
