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


# -- values that reach a job script (item 7) -------------------------------------------------


def _fail_if_submitted(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("nothing may be submitted")

    monkeypatch.setattr("hpctrain.launch.submit.make_executor", refuse)


@pytest.mark.parametrize("verb", ["submit", "sbatch"])
@pytest.mark.parametrize("key", ["run_dir", "slurm.folder"])
def test_a_newline_in_a_path_never_reaches_a_job_script(
    verb: str,
    key: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    _fail_if_submitted(monkeypatch)
    config = tmp_path / "run.yaml"
    section, _, name = key.rpartition(".")
    line = f'{name}: "{tmp_path}/run\\nhostname"'  # a YAML escape: a real newline
    config.write_text(f"{section}:\n  {line}\n" if section else line + "\n")
    extra = ["--dry-run"] if verb == "submit" else []
    code = main([verb, str(config), "--profile", "local-dev", "--no-preflight", *extra])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""  # no script printed
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert f"{key}='{tmp_path}/run\\nhostname': newlines" in captured.err


def test_sbatch_writes_its_log_into_slurm_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative slurm.folder is made absolute, like run_dir
    code = main(["sbatch", DEMO, "run_dir=run", "slurm.folder=logs", "--no-preflight"])
    script = capsys.readouterr().out
    assert code == 0
    assert f"#SBATCH --output={tmp_path}/logs/%j.out" in script
    assert f"slurm.folder={tmp_path}/logs" in script  # in config.yaml, for `hpctrain status`
    assert (tmp_path / "logs").is_dir() and not (tmp_path / "run" / "slurm").exists()


class _FakeJob:
    def __init__(self, folder: Path) -> None:
        self.job_id = "42"
        self.paths = type(
            "Paths", (), {"stdout": folder / "42_0_log.out", "stderr": folder / "42_0_log.err"}
        )


def test_submit_puts_submitit_files_into_slurm_folder_and_status_finds_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    folders: list[Path] = []

    class FakeExecutor:
        def __init__(self, job: object, folder: Path) -> None:
            folders.append(folder)

        def submit(self, fn: object) -> _FakeJob:
            return _FakeJob(folders[0])

    monkeypatch.setattr("hpctrain.launch.submit.make_executor", FakeExecutor)
    monkeypatch.setattr("hpctrain.launch.status.query_state", lambda job_id: ("RUNNING", "", 0))
    run, logs = tmp_path / "run", tmp_path / "logs"
    args = [DEMO, f"run_dir={run}", f"slurm.folder={logs}", "--profile", "local-dev"]
    assert main(["submit", *args, "--dry-run", "--no-preflight"]) == 0
    assert f"#SBATCH --output={logs}/submitit/%j_0_log.out" in capsys.readouterr().out
    assert main(["submit", *args, "--no-preflight"]) == 0
    assert folders == [logs / "submitit"]
    (logs / "submitit").mkdir()  # submitit's executor would have made it
    (logs / "submitit" / "42_0_log.err").write_text("hello from the job\n")
    assert main(["status", str(run)]) == 0
    assert "| hello from the job" in capsys.readouterr().out


def test_status_finds_an_sbatch_log_in_slurm_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.config import config_to_yaml, load_config

    run, logs = tmp_path / "run", tmp_path / "logs"
    (run / "slurm").mkdir(parents=True)
    logs.mkdir()
    # what the trainer saves from the rendered script's `slurm.folder=<absolute>` override
    (run / "config.yaml").write_text(config_to_yaml(load_config(None, [f"slurm.folder={logs}"])))
    (run / "slurm" / "job_id").write_text("7\n")
    (logs / "7.out").write_text("step 3\n")
    monkeypatch.setattr("hpctrain.launch.status.query_state", lambda job_id: ("RUNNING", "", 0))
    assert main(["status", str(run)]) == 0
    out = capsys.readouterr().out
    assert f"log:       {logs}/7.out" in out and "| step 3" in out
