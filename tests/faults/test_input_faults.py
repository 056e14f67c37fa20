"""Input faults (issue #14, items 7 and 8): every bad value or path a user can give reaches
the CLI as one line naming the key or path, with its kind's exit code, and no traceback.

Most cases call `hpctrain.cli.main.main` in this process (no torch import for the verbs that
do not need it); FAULTS.md lists each case with the test that injects it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.errors import EXIT_CHECKPOINT, EXIT_CONFIG, EXIT_DATA, EXIT_LAUNCH

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
    code = main([verb, str(config), "--profile", "local-dev", *extra])
    captured = capsys.readouterr()
    assert code == EXIT_LAUNCH and captured.out == ""  # no script printed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.yaml"]  # no folder made
    assert "Traceback" not in captured.err and captured.err.count("\n") == 1
    assert f"{key}='{tmp_path}/run\\nhostname': newlines" in captured.err


def test_sbatch_writes_its_log_into_slurm_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # a relative slurm.folder is made absolute (run_dir: run_root)
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
        def __init__(self, job: object, folder: Path, **options: object) -> None:
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


# -- every verb's bad inputs (item 8): one line naming the path or key, the kind's exit code --


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """root/shards (13 samples in 4 shards), root/missing (shard 1 gone), root/run.yaml."""
    from tests.convert.conftest import make_image_folder

    root = tmp_path_factory.mktemp("inputs")
    images = make_image_folder(root / "images", per_class=4)
    argv = ["convert", str(images), str(root / "shards"), "--samples-per-shard", "4"]
    assert main([*argv, "--progress", "none"]) == 0
    shutil.copytree(root / "shards", root / "missing")
    (root / "missing" / "shard-000001.tar").unlink()
    (root / "run.yaml").write_text(
        f"run_dir: {root / 'run'}\n"
        f"data:\n  train: {root / 'shards' / 'index.json'}\n  workers_per_rank: 0\n"
        "  batch_size: 4\ntrain:\n  max_steps: 1\n  precision: fp32\n"
    )
    (root / "a-file").write_text("not a folder\n")
    (root / "bad.yaml").write_text("train: [unclosed\n")
    (root / "step-dir" / "checkpoints" / "step-3").mkdir(parents=True)
    (root / "step-dir" / "checkpoints" / "step-3" / "manifest.json").write_text("{not json")
    (root / "step-dir" / "checkpoints" / "latest").write_text("step-3")
    (root / "no-job").mkdir()
    (root / "bad-job" / "slurm").mkdir(parents=True)
    (root / "bad-job" / "slurm" / "job.json").write_text("{cut")
    return root


UNREACHABLE = "http://127.0.0.1:9/x/index.json"  # the discard port: connection refused

# (verb and arguments with {root} for the data fixture's folder, exit code, fragment of the line)
CASES = {
    "config-missing-file": (["config", "show", "{root}/nope.yaml"], EXIT_CONFIG, "{root}/nope.yaml: No such file"),
    "config-folder-as-file": (["config", "show", "{root}"], EXIT_CONFIG, "{root}: Is a directory"),
    "config-invalid-yaml": (["config", "show", "{root}/bad.yaml"], EXIT_CONFIG, "{root}/bad.yaml line 2: not valid YAML"),
    "train-bad-nproc": (["train", "{root}/run.yaml", "--nproc", "0"], EXIT_CONFIG, "--nproc 0: must be >= 1"),
    "train-missing-config": (["train", "{root}/nope.yaml"], EXIT_CONFIG, "{root}/nope.yaml"),
    "plot-missing-run": (["plot", "{root}/nope"], EXIT_CONFIG, "{root}/nope/metrics.jsonl: no metrics"),
    "plot-folder-as-metrics": (["plot", "{root}/step-dir/.."], EXIT_CONFIG, "no metrics"),
    "export-missing-checkpoint": (["export", "{root}/nope", "{root}/o.pt"], EXIT_CHECKPOINT, "{root}/nope: no committed checkpoint"),
    "export-damaged-checkpoint": (["export", "{root}/step-dir/checkpoints/step-3", "{root}/o.pt"], EXIT_CHECKPOINT, "{root}/step-dir/checkpoints/step-3/manifest.json: unreadable manifest"),
    "convert-missing-source": (["convert", "{root}/nope", "{root}/out"], EXIT_DATA, "{root}/nope: source not found"),
    "convert-bad-option": (["convert", "{root}/images", "{root}/out", "--val-fraction", "2"], EXIT_CONFIG, "usage error: --val-fraction 2.0: must be in [0, 1)"),
    "convert-file-as-dest": (["convert", "{root}/images", "{root}/a-file"], EXIT_DATA, "{root}/a-file: cannot create the output folder"),
    "inspect-missing": (["inspect", "{root}/nope"], EXIT_DATA, "{root}/nope: not found"),
    "inspect-unreachable-url": (["inspect", UNREACHABLE], EXIT_DATA, UNREACHABLE),
    "plan-missing-index": (["plan", "{root}/nope", "--world-size", "2", "--batch-size", "2"], EXIT_DATA, "{root}/nope/index.json"),
    "plan-unreachable-url": (["plan", UNREACHABLE, "--world-size", "2", "--batch-size", "2"], EXIT_DATA, UNREACHABLE),
    "plan-bad-world-size": (["plan", "{root}/shards", "--world-size", "0", "--batch-size", "2"], EXIT_CONFIG, "--world-size"),
    "plan-rank-outside": (["plan", "{root}/shards", "--world-size", "2", "--batch-size", "2", "--rank", "5"], EXIT_CONFIG, "--rank 5 is outside world size 2"),
    "submit-missing-profile": (["submit", "{root}/run.yaml", "--profile", "nope"], EXIT_LAUNCH, "slurm.profile='nope': no such cluster profile"),
    "submit-missing-data": (["submit", "{root}/run.yaml", "data.train={root}/nope", "--profile", "local-dev"], EXIT_LAUNCH, "preflight failed, nothing submitted: data.train: {root}/nope/index.json: index not found"),
    "sbatch-missing-profile": (["sbatch", "{root}/run.yaml", "--profile", "nope"], EXIT_LAUNCH, "slurm.profile='nope'"),
    "sbatch-missing-data": (["sbatch", "{root}/run.yaml", "data.train={root}/nope", "--profile", "local-dev"], EXIT_LAUNCH, "preflight failed, nothing written: data.train: {root}/nope/index.json: index not found"),
    "sbatch-output-unwritable": (["sbatch", "{root}/run.yaml", "--no-preflight", "-o", "{root}/nope/job.sbatch"], EXIT_CONFIG, "-o {root}/nope/job.sbatch: cannot write: No such file"),
    "preflight-missing-profile": (["preflight", "{root}/run.yaml", "--profile", "nope"], EXIT_LAUNCH, "slurm.profile='nope'"),
    "preflight-unreachable-url": (["preflight", "{root}/run.yaml", f"data.train={UNREACHABLE}", "--profile", "local-dev"], EXIT_LAUNCH, f"preflight failed: data.train: {UNREACHABLE}"),
    "preflight-bad-task": (["preflight", "{root}/run.yaml", "task=nosuch.module:X", "--profile", "local-dev", "--no-data"], EXIT_LAUNCH, "task='nosuch.module:X': module nosuch.module not importable"),
    "status-missing-run": (["status", "{root}/nope"], EXIT_CONFIG, "{root}/nope: not a run folder"),
    "status-no-job": (["status", "{root}/no-job"], EXIT_LAUNCH, "{root}/no-job: no SLURM job recorded"),
    "status-damaged-record": (["status", "{root}/bad-job"], EXIT_LAUNCH, "{root}/bad-job/slurm/job.json: not a job record"),
    "bench-loader-missing-index": (["bench", "loader", "{root}/nope"], EXIT_DATA, "{root}/nope/index.json"),
    "bench-checkpoint-file-as-dir": (["bench", "checkpoint", "--dir", "{root}/a-file"], EXIT_CONFIG, "--dir {root}/a-file: cannot create"),
    "bench-convert-file-as-workdir": (["bench", "convert", "--workdir", "{root}/a-file/x"], EXIT_CONFIG, "--workdir {root}/a-file/x: cannot create"),
}  # fmt: skip


# preflight runs the job's Python in a login shell (torch imported): seconds each
PREFLIGHT_CASES = {"submit-missing-data", "sbatch-missing-data", "preflight-unreachable-url", "preflight-bad-task"}  # fmt: skip


@pytest.mark.parametrize(
    "case", [pytest.param(c, marks=[pytest.mark.slow] * (c in PREFLIGHT_CASES)) for c in CASES]
)
def test_bad_input_is_one_line_with_its_kind_exit_code(
    case: str, data: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv, code, fragment = CASES[case]
    argv = [a.replace("{root}", str(data)) for a in argv]
    assert main(argv) == code
    line = one_error_line(capsys)
    assert line.startswith(f"hpctrain {argv[0]}: ")
    assert fragment.replace("{root}", str(data)) in line


# `hpctrain train` logs a line or two before it fails: the error is the last line on stderr
TRAIN_CASES = {
    "missing-index": (["data.train={root}/nope/index.json"], EXIT_DATA, "data error: {root}/nope/index.json"),
    "missing-val-index": (["data.val={root}/nope/index.json"], EXIT_DATA, "data error: {root}/nope/index.json"),
    "unreachable-index": ([f"data.train={UNREACHABLE}"], EXIT_DATA, f"data error: {UNREACHABLE}"),
    "missing-shard": (["data.train={root}/missing/index.json"], EXIT_DATA, "data error: {root}/missing/shard-000001.tar"),
    "bad-task-module": (["task=nosuch.module:X"], EXIT_CONFIG, "config error: task='nosuch.module:X': cannot import nosuch.module"),
    "unknown-signal": (["checkpoint.signals=[FOO]"], EXIT_CONFIG, "config error: checkpoint.signals: unknown signal 'FOO'"),
    "too-few-classes": (["model.num_classes=2"], EXIT_CONFIG, "config error: model.num_classes=2: the index {root}/shards names 3 classes"),
    "missing-resume-checkpoint": (["--resume", "{root}/nope"], EXIT_CHECKPOINT, "checkpoint error: {root}/nope"),
    "file-as-run-dir": (["run_dir={root}/a-file"], EXIT_CHECKPOINT, "{root}/a-file/checkpoints: cannot use the checkpoint folder"),
    "file-as-checkpoint-dir": (["checkpoint.dir={root}/a-file"], EXIT_CHECKPOINT, "{root}/a-file: cannot use the checkpoint folder"),
    "unreachable-checkpoint-dir": (["checkpoint.dir=http://127.0.0.1:9/c"], EXIT_CHECKPOINT, "http://127.0.0.1:9/c: cannot use the checkpoint folder"),
}  # fmt: skip


@pytest.mark.parametrize("case", TRAIN_CASES)
def test_train_bad_input_ends_in_one_line_with_its_kind_exit_code(
    case: str, data: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    extra, code, fragment = TRAIN_CASES[case]
    argv = ["train", f"{data}/run.yaml", f"run_dir={tmp_path / 'run'}"]
    argv += [a.replace("{root}", str(data)) for a in extra]
    assert main(argv) == code
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert [line for line in err.splitlines() if line.startswith("hpctrain train: ")] == [
        err.strip().splitlines()[-1]
    ]
    assert fragment.replace("{root}", str(data)) in err.strip().splitlines()[-1]


@contextlib.contextmanager
def without_root() -> Iterator[None]:
    """Run the block as user nobody when this process is root (root reads a mode-000 file)."""
    if os.geteuid() != 0:
        yield
        return
    os.setegid(65534)
    os.seteuid(65534)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)


def test_permission_denied_names_the_file(data: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = Path(tempfile.mkdtemp(prefix="hpctrain-denied-"))  # not under root's 0700 tmp
    try:
        folder.chmod(0o755)
        shutil.copy(data / "run.yaml", folder / "run.yaml")
        shutil.copy(data / "shards" / "index.json", folder / "index.json")
        shutil.copy(REPO / "configs" / "clusters" / "local-dev.yaml", folder / "site.yaml")
        cases = [
            (["config", "show", f"{folder}/run.yaml"], EXIT_CONFIG, "run.yaml"),
            (["plan", f"{folder}/index.json", "--world-size", "1", "--batch-size", "1"],
             EXIT_DATA, "index.json"),
            (["sbatch", f"{folder}/run.yaml", f"run_dir={folder}/run", "--no-preflight",
              "--profile", f"{folder}/site.yaml"], EXIT_LAUNCH, "site.yaml"),
        ]  # fmt: skip
        for argv, _, _ in cases:  # as root first: every module a verb imports is loaded
            assert main(argv) == 0, capsys.readouterr().err
        capsys.readouterr()
        for argv, code, name in cases:
            (folder / name).chmod(0)
            with without_root():
                got = main(argv)
            (folder / name).chmod(0o644)
            line = one_error_line(capsys)
            assert got == code and f"{folder}/{name}" in line and "Permission denied" in line, line
    finally:
        shutil.rmtree(folder)


@pytest.mark.distributed  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_a_data_error_in_two_local_ranks_is_one_line_per_rank_and_exit_3(
    data: Path, tmp_path: Path
) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    argv = [sys.executable, "-m", "hpctrain", "train", f"{data}/run.yaml"]
    argv += [f"run_dir={tmp_path / 'run'}", f"data.train={data}/nope/index.json", "--nproc", "2"]
    proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == EXIT_DATA, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = sorted(line for line in proc.stderr.splitlines() if line.startswith("hpctrain "))
    assert errors == [
        f"hpctrain train [rank {r}]: data error: {data}/nope/index.json: index not found"
        for r in (0, 1)
    ]
