"""Every `hpctrain bench` case runs as shipped, at a tiny size on the CPU (the GPU case with
`--device cpu` and its dry run), so that a change of a shipped config or of the Trainer's
checks cannot break a benchmark unnoticed (issue #44: the demo config's `checkpoint.monitor`
once broke `hpctrain bench trainer` with its defaults).

A case that another test already runs end to end at a tiny size is named here by that test
(a multi-rank case costs tens of seconds: run once); `test_every_case_is_run` fails when a
case is added to `hpctrain.cli.bench.BENCHES` without a tiny run.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from hpctrain.cli.bench import BENCHES
from hpctrain.cli.main import main
from tests.support.train_kit import REPO

# case -> the test that runs it end to end at a tiny size
ELSEWHERE = {
    "checkpoint": "tests/bench/test_checkpoint.py::test_bench_checkpoint_tiny",
    "loader": "tests/bench/test_loader.py::test_bench_loader_runs_all_cases",
    "mesh": "tests/bench/test_mesh.py::test_bench_mesh_reports_paired_ratios",
    "import": "tests/bench/test_weights_import.py::test_import_bench_loads_both_ways_and_reports",
    "gpu-lm": "tests/bench/test_gpu_lm.py::test_cpu_run_reports_tokens_and_data_wait",
    # the bench's node case (16 processes, one compact index read), small
    "index": "tests/data/test_compact_index.py::test_sixteen_local_processes_read_the_compact_index_once",
    # job arrays: needs the SLURM dev cluster
    "convert-parts": "tests/launch/test_convert_array.py::test_bench_convert_parts_runs_tiny",
}
# label -> (case, arguments of a tiny run); run here
TINY = {
    "trainer": (
        "trainer",
        ["--pairs", "0", "--mlp-pairs", "1", "--mlp-steps", "2", "--demo-steps", "3", "--json"],
    ),
    "trainer-lm": (
        "trainer",
        ["--task", "causal_lm", "--gpt-pairs", "1", "--gpt-steps", "1", "--seq-len", "16"],
    ),
    "convert": (
        "convert",
        ["--num-images", "20", "--size", "32", "--samples-per-shard", "10", "--rounds", "1"],
    ),
    "gpu-lm-dry-run": ("gpu-lm", ["--preset", "gpt-1b", "--steps", "2", "--dry-run"]),
    "probe": ("probe", ["--peers", "16", "--processes", "2", "--rounds", "1"]),
    "attempts": (
        "attempts",
        [
            "--nodes",
            "4",
            "--tasks-per-node",
            "2",
            "--per-rank-sample",
            "4",
            "--beat-steps",
            "100",
            "--json",
        ],
    ),
    "lora": (
        "lora",
        [
            "--preset",
            "gpt-tiny",
            "--vocab",
            "300",
            "--seq-len",
            "16",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--pairs",
            "1",
            "--json",
        ],
    ),
    "generate": (
        "generate",
        [
            "--preset",
            "gpt-tiny",
            "--layers",
            "1",
            "--vocab",
            "300",
            "--batches",
            "1,2",
            "--prompt-tokens",
            "8",
            "--new-tokens",
            "4",
            "--repeats",
            "1",
            "--json",
        ],
    ),
}


def test_every_case_is_run() -> None:
    here = {case for case, _ in TINY.values()}
    assert here | set(ELSEWHERE) == set(BENCHES)
    for where in ELSEWHERE.values():
        path, _, name = where.partition("::")
        text = (REPO / path).read_text()
        assert f"def {name}(" in text, where


@pytest.mark.slow  # seconds each
@pytest.mark.parametrize("case", sorted(TINY))
def test_a_case_runs_as_shipped(
    case: str, shapes_shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    name, args = TINY[case][0], list(TINY[case][1])
    if case == "trainer":
        # The demo config (configs/demo.yaml) as shipped, on the suite's small shape shards.
        args += ["--demo-shards", str(shapes_shards)]
    if case == "gpu-lm-dry-run":
        args += ["--work", str(tmp_path / "lm")]
    if name == "convert":
        args += ["--workdir", str(tmp_path / "convert")]
    if name == "attempts":
        args += ["--dir", str(tmp_path / "attempts")]
    threads, level = torch.get_num_threads(), logging.getLogger("hpctrain").level
    # in this process: the imports are paid once for every case; a case leaves the process as
    # it found it (`bench trainer` quietened the package's log for the tests after it)
    assert main(["bench", name, *args]) == 0
    assert (torch.get_num_threads(), logging.getLogger("hpctrain").level) == (threads, level)
    out = capsys.readouterr().out
    if case == "trainer":
        result = json.loads(out)
        assert [r["model"] for r in result["compare"]] == ["mlp"]
        wait = result["data_wait"]
        assert wait["steps"] == 3 and 0 <= wait["data_wait_fraction"] <= 1
    elif case == "trainer-lm":
        assert "gpt-tiny+docs cpu time: Trainer / reference loop = " in out
    elif case == "convert":
        assert "hpctrain --workers 1" in out
    elif case == "lora":  # the goals are for gpt-125m: only that every kind ran and was measured
        kinds = set(json.loads(out)["runs"])
        assert kinds == {"full", "lora"}, out
    elif case == "attempts":  # one record per node; both forms read to the same verdict
        result = json.loads(out)
        assert result["per_node"]["files"] == 4 and result["per_rank"]["files"] == 8
        assert result["per_node"]["kind"] == result["per_rank"]["kind"] == "signal"
        assert not list((tmp_path / "attempts").iterdir())  # its files are gone
    elif case == "generate":
        assert all(row["identical"] for row in json.loads(out)["rows"]), out
    elif case == "probe":  # the serial hub (the baseline) and the shipped one, side by side
        assert "\nconcurrent " in out and "16/16" in out and "budget: met" in out, out
    else:  # the dry run: the Trainer of the one-H200 plan built on the CPU, nothing trained
        assert "lm gpt-1b config valid: none (single process), bf16, " in out
        assert not (tmp_path / "lm" / "run").exists()
