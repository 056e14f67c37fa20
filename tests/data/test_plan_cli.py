"""`hpctrain plan`: text and JSON output on real shards, errors naming the data."""

from __future__ import annotations

import json

from hpctrain.cli.main import main
from tests.data.loader_testkit import make_shards


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
