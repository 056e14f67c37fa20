"""`profile.steps`: a readable trace of the chosen steps, on the chosen ranks only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hpctrain.config import ConfigError
from hpctrain.observe.profiling import StepProfiler, parse_steps


def run_steps(profiler: StepProfiler, steps: range) -> None:
    model = torch.nn.Linear(32, 32)
    for done in steps:
        profiler.at_step(done)
        with torch.profiler.record_function(f"hpctrain_test_step_{done + 1}"):
            model(torch.randn(8, 32)).sum().backward()
    profiler.close()


def names_in(trace: Path) -> set[str]:
    events = json.loads(trace.read_text())["traceEvents"]
    return {event.get("name", "") for event in events}


def test_trace_of_the_chosen_steps_is_written_and_readable(tmp_path):
    profiler = StepProfiler(
        "3-4", [0], rank=0, world_size=2, run_dir=tmp_path, device=torch.device("cpu")
    )
    run_steps(profiler, range(0, 6))  # steps 1..6
    trace = tmp_path / "profile" / "rank-0.steps-3-4.pt.trace.json"
    names = names_in(trace)
    assert {"hpctrain_test_step_3", "hpctrain_test_step_4"} <= names
    assert not names & {"hpctrain_test_step_2", "hpctrain_test_step_5"}  # only those steps
    assert any(name.startswith("aten::") for name in names)  # CPU operators recorded


def test_other_ranks_record_nothing_and_a_resume_inside_the_range_records_the_rest(tmp_path):
    other = StepProfiler(
        "2-3", [0], rank=1, world_size=2, run_dir=tmp_path, device=torch.device("cpu")
    )
    run_steps(other, range(0, 4))
    assert not (tmp_path / "profile").exists()
    resumed = StepProfiler(
        "2-5", [], rank=1, world_size=2, run_dir=tmp_path, device=torch.device("cpu")
    )
    run_steps(resumed, range(3, 4))  # resumed after step 3; preempted after step 4
    names = names_in(tmp_path / "profile" / "rank-1.steps-2-5.pt.trace.json")
    assert "hpctrain_test_step_4" in names and "hpctrain_test_step_3" not in names


def test_bad_profile_settings_are_named(tmp_path):
    assert parse_steps("") is None and parse_steps(" 10 - 12 ") == (10, 12)
    for text in ("5", "0-3", "4-2", "a-b"):
        with pytest.raises(ConfigError, match=f"profile.steps='{text}': must be START-END"):
            parse_steps(text)
    with pytest.raises(ConfigError, match=r"profile.ranks=\[2\]: the run has 2 rank\(s\), 0..1"):
        StepProfiler("1-2", [2], rank=0, world_size=2, run_dir=tmp_path, device=torch.device("cpu"))


CPU_ONLY_SCENARIO = """
import sys
from pathlib import Path
import torch
from hpctrain.observe.profiling import StepProfiler

profiler = StepProfiler("1-2", [], rank=0, world_size=1, run_dir=Path(sys.argv[1]),
                        device=torch.device("cpu"))
model = torch.nn.Linear(8, 8)
for done in range(3):
    profiler.at_step(done)
    model(torch.randn(4, 8)).sum().backward()
profiler.close()
"""


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_profiling_without_a_gpu_prints_no_alarming_error(tmp_path):
    """Issue 32: torch's profiler logged `ERROR: ... gpuGetDeviceCount failed` on CPU-only
    machines. A fresh process: Kineto reads its log level once, at its first use."""
    env = {k: v for k, v in os.environ.items() if k != "KINETO_LOG_LEVEL"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(Path(__file__).parents[2] / "src"))
    done = subprocess.run(
        [sys.executable, "-c", CPU_ONLY_SCENARIO, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    assert "gpuGetDeviceCount" not in done.stderr and "ERROR" not in done.stderr, done.stderr
    assert "aten::" in (tmp_path / "profile" / "rank-0.steps-1-2.pt.trace.json").read_text()
