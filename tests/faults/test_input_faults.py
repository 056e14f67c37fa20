"""Input faults (issue #14, items 7 and 8): every bad value or path a user can give reaches
the CLI as one line naming the key or path, with its kind's exit code, and no traceback.

Most cases call `hpctrain.cli.main.main` in this process (no torch import for the verbs that
do not need it); FAULTS.md lists each case with the test that injects it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.errors import EXIT_CONFIG

REPO = Path(__file__).resolve().parents[2]
DEMO = str(REPO / "configs" / "demo.yaml")


def one_error_line(capsys: pytest.CaptureFixture[str]) -> str:
    """The single line the CLI printed on stderr (and that it printed no traceback)."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


# -- config values (item 7) -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("train.lr=.nan", "train.lr=nan (command line): expected a finite number"),
        ("train.lr=.inf", "train.lr=inf (command line): expected a finite number"),
        ("train.momentum=-.inf", "train.momentum=-inf (command line): expected a finite number"),
        ("checkpoint.deadline_margin_s=.nan", "checkpoint.deadline_margin_s=nan"),
        ("checkpoint.every_minutes=.inf", "checkpoint.every_minutes=inf"),
        ("train.grad_clip=1" + "0" * 400, "train.grad_clip=1000"),  # beyond any float
        ("seed=9223372036854775808", "seed=9223372036854775808 (command line): out of range"),
        ("seed=-1", "seed=-1 (command line): must be >= 0"),
        ("train.max_steps=18446744073709551616", "out of range for a 64-bit integer"),
        ("slurm.signal_margin_s=65536", "slurm.signal_margin_s=65536 (command line): must be <="),
    ],
)
def test_non_finite_and_out_of_range_numbers_are_refused_with_the_key(
    override: str, fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "show", DEMO, override]) == EXIT_CONFIG
    line = one_error_line(capsys)
    assert line.startswith("hpctrain config: config error: ")
    assert fragment in line


def test_the_largest_seed_is_accepted(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "show", DEMO, f"seed={2**63 - 1}"]) == 0
    assert f"seed: {2**63 - 1}" in capsys.readouterr().out


def test_a_nan_in_the_config_file_names_the_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "run.yaml"
    path.write_text("train:\n  lr: .NaN\n")
    assert main(["config", "show", str(path)]) == EXIT_CONFIG
    assert f"train.lr=nan ({path}): expected a finite number" in one_error_line(capsys)
