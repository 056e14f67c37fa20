"""Ctrl-C outside the training loop: one line saying what is left, exit 130, no traceback.

`convert` gets a real SIGINT to its process group while it reads a Python dataset; `eval`,
`predict` and `export` are interrupted where their work runs (their `run`, which imports
torch and reads the checkpoint), in this process: their outputs are written under temporary
names (tests/inference and tests/train cover those), so what is checked here is the line and
the code. The training loop's own Ctrl-C (save, then 130): tests/train/test_interrupt.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hpctrain.cli import main as cli_main

REPO = Path(__file__).resolve().parents[2]

SLOW_DATASET = """
import time
from pathlib import Path

def samples(count="2000", pause_s="0.05", started=""):
    for i in range(int(count)):
        if i == 3 and started:
            Path(started).touch()  # the conversion is under way: interrupt it now
        time.sleep(float(pause_s))
        yield {"__key__": f"s{i:05d}", "cls": i % 2, "txt": f"sample {i}"}
"""


@pytest.mark.slow
def test_ctrl_c_during_convert_is_one_line_and_a_rerun_with_resume_finishes(
    tmp_path: Path,
) -> None:
    (tmp_path / "slow_dataset.py").write_text(textwrap.dedent(SLOW_DATASET))
    started = tmp_path / "started"
    command = [sys.executable, "-m", "hpctrain", "convert", "slow_dataset:samples", "out"]
    args = ["--samples-per-shard", "100", "--arg", "count=400"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    proc = subprocess.Popen(
        [*command, *args, "--arg", f"started={started}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while proc.poll() is None and not started.exists():
        assert time.monotonic() < deadline, "the conversion did not start"
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err
    assert "Traceback" not in err, err
    last = err.rstrip().splitlines()[-1]
    assert last == (
        "hpctrain convert: interrupted: out keeps its finished shards and has no index yet; "
        "the same command with --resume finishes it (--overwrite starts again)"
    )
    assert not (tmp_path / "out" / "index.json").exists()  # nothing reads it as a dataset
    done = subprocess.run(
        [*command, *args, "--arg", "pause_s=0", "--resume"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "out" / "index.json").exists()


@pytest.mark.parametrize(
    ("argv", "line"),
    [
        (
            ["eval", "runs/x"],
            "hpctrain eval: interrupted: nothing written: run the same command again",
        ),
        (
            ["predict", "runs/x", "--out", "preds"],
            "hpctrain predict: interrupted: preds has no manifest.json (written last): "
            "run the same command again",
        ),
        (
            ["export", "runs/x", "-o", "model.pt"],
            "hpctrain export: interrupted: nothing half-written at model.pt: "
            "run the same command again",
        ),
    ],
    ids=["eval", "predict", "export"],
)
def test_ctrl_c_in_a_verb_is_one_line_and_exit_130(
    argv: list[str],
    line: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    module = sys.modules.get(f"hpctrain.cli.{argv[0]}") or __import__(
        f"hpctrain.cli.{argv[0]}", fromlist=["run"]
    )

    def run(_args: object) -> int:
        raise KeyboardInterrupt  # what Ctrl-C raises where the verb's work runs

    monkeypatch.setattr(module, "run", run)
    previous = signal.getsignal(signal.SIGINT)
    assert cli_main.main(argv) == 130
    assert signal.getsignal(signal.SIGINT) is previous  # called in-process: left as it was
    err = capsys.readouterr().err
    assert err == line + "\n"
