"""`hpctrain --help` and every verb's `--help` work and show an example."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hpctrain.cli.main import (
    DEBUG_ENV,
    EXIT_BROKEN_PIPE,
    VERBS,
    build_parser,
    main,
    parse_arguments,
    requested_verb,
)
from hpctrain.errors import EXIT_CONFIG, EXIT_DATA


def test_top_level_help_lists_every_verb(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for verb in VERBS:
        assert verb in out


@pytest.mark.parametrize("verb", VERBS)
def test_every_verb_help_has_an_example(verb: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main([verb, "--help"])
    assert exit_info.value.code == 0
    assert "example" in capsys.readouterr().out


def test_only_the_requested_verb_is_loaded() -> None:
    assert requested_verb(["--version"]) is None
    assert requested_verb(["plan", "x"]) == "plan"
    parser = build_parser(["config"])
    assert parser.parse_args(["config", "show", "c.yaml"]).verb == "config"


def config_show(override: str) -> subprocess.CompletedProcess[str]:
    """`python -m hpctrain config show configs/demo.yaml OVERRIDE` (the module entry point)."""
    command = [sys.executable, "-m", "hpctrain", "config", "show", "configs/demo.yaml", override]
    return subprocess.run(command, capture_output=True, text=True)


def test_module_entry_point_and_config_errors_exit_2() -> None:
    proc = config_show("train.max_steps=7")
    assert proc.returncode == 0, proc.stderr
    assert "max_steps: 7" in proc.stdout
    proc = config_show("data.batch_size=-1")
    assert proc.returncode == 2 and "data.batch_size=-1" in proc.stderr


def _missing_index_plan(tmp_path: Path) -> list[str]:
    return ["plan", str(tmp_path / "nowhere"), "--world-size", "1", "--batch-size", "1"]


@pytest.mark.parametrize("how", ["flag", "env"])
def test_debug_shows_the_traceback_of_a_user_error(
    how: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(DEBUG_ENV, "1" if how == "env" else "0")  # restored after the test
    argv = _missing_index_plan(tmp_path)
    assert main(["--debug", *argv] if how == "flag" else argv) == EXIT_DATA
    err = capsys.readouterr().err
    assert err.startswith("Traceback") and "ShardIndexError" in err
    assert err.splitlines()[-1].startswith("hpctrain plan: data error: ")
    assert os.environ[DEBUG_ENV] == "1"  # `train --nproc` ranks inherit it


def test_without_debug_a_user_error_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert main(_missing_index_plan(tmp_path)) == EXIT_DATA
    assert capsys.readouterr().err.count("\n") == 1


def test_train_debug_mode_shows_tracebacks_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(DEBUG_ENV, raising=False)
    assert main(["train", str(tmp_path / "nope.yaml"), "--debug"]) == EXIT_CONFIG
    err = capsys.readouterr().err
    assert "Traceback" in err and "ConfigError" in err


def test_an_unexpected_error_keeps_its_traceback(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def bug(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr("hpctrain.data.plan_report.open_index", bug)
    with pytest.raises(RuntimeError, match="a bug"):  # Python prints it and exits 1
        main(_missing_index_plan(tmp_path))


def test_readme_exit_codes_match_hpctrain_errors() -> None:
    from hpctrain.config import ConfigError
    from hpctrain.errors import CheckpointFailure, DataError, LaunchFailure, RunLockedError

    table = (Path(__file__).resolve().parents[2] / "docs" / "errors.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| ([^|]+) \|", table, re.MULTILINE))
    for kind in (ConfigError, DataError, CheckpointFailure, RunLockedError, LaunchFailure):
        assert rows[str(kind.exit_code)].split()[0] == kind.label.split()[0], kind
    assert rows["1"].startswith("a bug") and rows["75"].startswith("not an error")


# Options and `key=value` overrides in any order after the verb (issue #17).
INTERMIXED = {
    "train": (["c.yaml", "--nproc", "2", "train.max_steps=7", "--resume", "none", "seed=1"],
              {"config": "c.yaml", "overrides": ["train.max_steps=7", "seed=1"], "nproc": 2, "checkpoint": "none"}),
    "config": (["show", "c.yaml", "a.b=1", "c=2"], {"config": "c.yaml", "overrides": ["a.b=1", "c=2"]}),
    "plot": (["runs/x"], {"run_dir": "runs/x"}),
    "export": (["runs/x", "out.pt"], {"source": "runs/x", "out": "out.pt"}),
    "sync": (["--dry-run", "runs/x"], {"run_dir": "runs/x", "dry_run": True}),
    "convert": (["--shuffle", "src", "--seed", "3", "dest"], {"src": "src", "dest": "dest", "seed": 3, "shuffle": True}),
    "inspect": (["--verify", "d", "--keys", "2"], {"dest": "d", "verify": True, "keys": 2}),
    "plan": (["--world-size", "2", "d", "--batch-size", "3"], {"data": ["d"], "world_size": 2, "batch_size": 3}),
    "submit": (["c.yaml", "--dry-run", "slurm.nodes=2", "--sweep", "train.lr=-1,-2", "seed=3"],
               {"overrides": ["slurm.nodes=2", "seed=3"], "sweep": ["train.lr=-1,-2"], "dry_run": True}),
    # a value that looks like an option after `=` is still an override
    "sbatch": (["c.yaml", "-o", "j.sbatch", "slurm.nodes=2", "--profile", "generic", "task_options.flag=--x"],
               {"overrides": ["slurm.nodes=2", "task_options.flag=--x"], "output": "j.sbatch", "profile": "generic"}),
    "preflight": (["c.yaml", "--no-data", "slurm.time=1:00:00"], {"overrides": ["slurm.time=1:00:00"], "no_data": True}),
    "status": (["-n", "3", "runs/x", "--json"], {"run_dir": "runs/x", "lines": 3, "json": True}),
    "bench": (["loader", "--workers", "1", "d"], {"bench": "loader", "data": "d", "workers": 1}),
    "index": (["compact", "a/index.json", "b"], {"action": "compact", "indexes": ["a/index.json", "b"]}),
    "eval": (["runs/x", "data.val=v", "--checkpoint", "best", "--nproc", "2"],
             {"source": "runs/x", "overrides": ["data.val=v"], "checkpoint": "best", "nproc": 2}),
    "predict": (["runs/x", "--out", "p", "seed=1", "--format", "shards"],
                {"source": "runs/x", "overrides": ["seed=1"], "out": "p", "format": "shards"}),
    "generate": (["--prompt", "hi", "runs/x", "--top-k", "3"], {"source": "runs/x", "prompt": "hi", "top_k": 3}),
}  # fmt: skip


def test_every_verb_is_covered_by_the_intermixed_cases() -> None:
    assert sorted(INTERMIXED) == sorted(VERBS)


@pytest.mark.parametrize("verb", VERBS)
def test_options_and_overrides_in_any_order(verb: str) -> None:
    rest, expected = INTERMIXED[verb]
    args = parse_arguments(build_parser([verb]), ["--debug", verb, *rest])
    assert args.verb == verb and args.show_tracebacks
    assert {key: getattr(args, key) for key in expected} == expected


# Overrides before the config path too (issue #32 item 5): a key=value is never the path.
OVERRIDE_FIRST = {
    "train": ["run_dir=runs/x", "c.yaml", "seed=1"],
    "config": ["show", "run_dir=runs/x", "c.yaml", "seed=1"],
    "submit": ["run_dir=runs/x", "--dry-run", "c.yaml", "seed=1"],
    "sbatch": ["run_dir=runs/x", "c.yaml", "seed=1", "--profile", "generic"],
    "preflight": ["run_dir=runs/x", "--no-data", "c.yaml", "seed=1"],
    "eval": ["run_dir=runs/x", "c.yaml", "--nproc", "2", "seed=1"],
    "predict": ["run_dir=runs/x", "--out", "p", "c.yaml", "seed=1"],
}


@pytest.mark.parametrize("verb", sorted(OVERRIDE_FIRST))
def test_an_override_before_the_config_path_is_an_override(verb: str) -> None:
    args = parse_arguments(build_parser([verb]), [verb, *OVERRIDE_FIRST[verb]])
    assert getattr(args, "source" if verb in ("eval", "predict") else "config") == "c.yaml"
    assert args.overrides == ["run_dir=runs/x", "seed=1"]  # in their order: the last one wins


def test_a_path_with_an_equals_sign_is_still_a_path() -> None:
    args = parse_arguments(build_parser(["train"]), ["train", "runs/lr=0.1/config.yaml", "seed=1"])
    assert (args.config, args.overrides) == ("runs/lr=0.1/config.yaml", ["seed=1"])


def test_only_overrides_and_no_config_path_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(build_parser(["train"]), ["train", "run_dir=runs/x", "seed=1"])
    assert exit_info.value.code == 2
    assert "required: config (KEY=VALUE is an override)" in capsys.readouterr().err


def test_an_override_after_an_option_reaches_the_job_script(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    demo = str(Path(__file__).resolve().parents[2] / "configs" / "demo.yaml")
    argv = ["sbatch", demo, "--no-preflight", "train.max_steps=7", "--profile", "generic"]
    assert main([*argv, f"run_dir={tmp_path}"]) == 0
    assert '"run_dir=$RUN_DIR" train.max_steps=7)\n' in capsys.readouterr().out


def test_a_multi_line_message_is_printed_as_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.errors import DataError

    def fail(*args: object) -> None:
        raise DataError("x.json: bad\nsecond line from a library")

    monkeypatch.delenv(DEBUG_ENV, raising=False)
    monkeypatch.setattr("hpctrain.data.plan_report.open_index", fail)
    assert main(_missing_index_plan(tmp_path)) == EXIT_DATA
    err = capsys.readouterr().err
    assert err == "hpctrain plan: data error: x.json: bad second line from a library\n"


@pytest.mark.parametrize(
    "env", [{"RANK": "1", "WORLD_SIZE": "2"}, {"SLURM_PROCID": "3", "SLURM_NTASKS": "4"}]
)
def test_a_rank_of_a_multi_process_run_tags_its_line(
    env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    rank = env.get("RANK", env.get("SLURM_PROCID"))
    assert main(["train", str(tmp_path / "nope.yaml")]) == EXIT_CONFIG
    assert capsys.readouterr().err.startswith(f"hpctrain train [rank {rank}]: config error: ")


def test_an_error_line_is_one_write_even_unbuffered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Ranks sharing one stderr keep whole lines only if each line is one write: print()
    writes the newline apart, and under PYTHONUNBUFFERED=1 that is a second write(2), after
    which another rank's line could land (CI once saw two ranks' lines run together)."""
    writes: list[str] = []

    class Unbuffered:  # what sys.stderr passes to write(2) under PYTHONUNBUFFERED=1
        def write(self, text: str) -> int:
            writes.append(text)
            return len(text)

        def flush(self) -> None:
            pass

    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", DEBUG_ENV):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr("sys.stderr", Unbuffered())
    assert main(["train", str(tmp_path / "nope.yaml")]) == EXIT_CONFIG
    assert len(writes) == 1 and writes[0].startswith("hpctrain train [rank 1]: config error: ")
    assert writes[0].endswith("\n"), writes


def _into_a_closed_pipe(*args: str) -> tuple[int, str]:
    """`python -m hpctrain ARGS | head -1` where head has already gone: the reading end of a
    real pipe is closed before the verb writes, so every write meets EPIPE."""
    command = [sys.executable, "-m", "hpctrain", *args]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()
    err = proc.stderr.read()
    return proc.wait(), err


def test_a_reader_that_closes_early_ends_the_verb_quietly(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello world " * 50)
    dest = tmp_path / "tokens"
    argv = ["convert", str(corpus), str(dest), "--tokenizer", "bytes", "--progress", "none"]
    assert main([*argv, "--sample-tokens", "4"]) == 0
    # inspect prints its report in one go (a BrokenPipeError traceback in the verb); config
    # show's few lines were still buffered (a second error while Python flushed at exit).
    for args in (["inspect", str(dest)], ["config", "show", "configs/demo.yaml"]):
        code, err = _into_a_closed_pipe(*args)
        assert (code, err) == (EXIT_BROKEN_PIPE, ""), args
    code, err = _into_a_closed_pipe("inspect", str(tmp_path / "nowhere"))
    assert code == EXIT_DATA and err.count("\n") == 1  # an error keeps its code and line


# Every `--help` and `config show` start without torch (#43 item 11: `hpctrain --help` took
# 21-23 s importing torch and DCP). One process runs them all, checking after each.
LIGHT_COMMANDS = [
    ["--help"],
    *[[verb, "--help"] for verb in VERBS],
    ["bench", "convert", "--help"],  # one bench: only its own module is imported
    ["config", "show", "configs/demo.yaml"],
    ["nosuchverb"],
    ["plot", "/nonexistent/run"],  # fails before matplotlib is imported
]
LIGHT_CHECK = """
import contextlib, io, json, sys
from hpctrain.cli.main import main
heavy = ("torch", "submitit", "matplotlib")
for argv in json.loads(sys.argv[1]):
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        try:
            main(argv)
        except SystemExit:
            pass
    loaded = [name for name in heavy if name in sys.modules]
    if loaded:
        print(" ".join(argv), "imported", ", ".join(loaded))
        break
"""


def test_help_and_config_show_import_no_torch() -> None:
    import json

    proc = subprocess.run(
        [sys.executable, "-c", LIGHT_CHECK, json.dumps(LIGHT_COMMANDS)],
        capture_output=True,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == ""


def test_convert_s_part_stages_are_the_conversion_s_own() -> None:
    from hpctrain.cli.convert import PART_STAGES
    from hpctrain.convert.parts import STAGES

    assert PART_STAGES == STAGES


def test_the_bench_help_lines_are_the_benches_own() -> None:
    """`hpctrain bench --help` lists each bench from cli/bench.py's copy of its HELP line."""
    import ast
    import importlib.util

    from hpctrain.cli.bench import BENCHES

    for name, (module_path, line) in BENCHES.items():
        spec = importlib.util.find_spec(module_path)
        assert spec is not None and spec.origin is not None
        tree = ast.parse(Path(spec.origin).read_text())
        helps = [
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id == "HELP" for t in node.targets)
        ]
        assert helps == [line], name


# One vocabulary across verbs (#43 item 12): the older spellings parse to the same arguments.
SAME_ARGUMENTS = [
    (["export", "runs/x", "m.pt", "--best"], ["export", "runs/x", "-o", "m.pt", "--checkpoint", "best"]),
    (["export", "runs/x", "m.pt"], ["export", "runs/x", "--out", "m.pt"]),
    (["train", "c.yaml", "--resume", "none"], ["train", "c.yaml", "--checkpoint", "none"]),
    (["sbatch", "c.yaml", "--output", "j.sh"], ["sbatch", "c.yaml", "--out", "j.sh"]),
    (["sbatch", "c.yaml", "-o", "j.sh"], ["sbatch", "c.yaml", "--out", "j.sh"]),
    (["convert", "src", "dest"], ["convert", "src", "-o", "dest"]),
    (["eval", "runs/x", "--out", "e.json"], ["eval", "runs/x", "-o", "e.json"]),
    (["predict", "runs/x", "--out", "p"], ["predict", "runs/x", "-o", "p"]),
    (["submit", "runs/x", "--eval", "--out", "e.json"], ["submit", "runs/x", "--eval", "-o", "e.json"]),
]  # fmt: skip


@pytest.mark.parametrize(("old", "new"), SAME_ARGUMENTS, ids=[old[0] for old, _ in SAME_ARGUMENTS])
def test_older_spellings_are_aliases(old: list[str], new: list[str]) -> None:
    def parsed(argv: list[str]) -> dict[str, object]:
        args = vars(parse_arguments(build_parser([argv[0]]), argv))
        return {k: v for k, v in args.items() if not k.startswith("_")}

    assert parsed(old) == parsed(new)


def test_every_verb_that_chooses_a_checkpoint_takes_a_path(tmp_path: Path) -> None:
    step = str(tmp_path / "checkpoints" / "step-4")
    for verb, rest in [
        ("eval", ["runs/x"]),
        ("predict", ["runs/x"]),
        ("export", ["runs/x", "-o", "m.pt"]),
        ("generate", ["runs/x", "--prompt", "a"]),
        ("train", ["c.yaml"]),
        ("submit", ["runs/x", "--eval"]),
    ]:
        args = parse_arguments(build_parser([verb]), [verb, *rest, "--checkpoint", step])
        assert args.checkpoint == step, verb


def test_two_outputs_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        parse_arguments(build_parser(["export"]), ["export", "runs/x", "a.pt", "-o", "b.pt"])
    assert exit_info.value.code == 2
    assert "two outputs: b.pt and a.pt; give one (-o/--out)" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["export", "runs/x"], "export needs the file to write: -o OUT"),
        (["convert", "src"], "convert needs the output folder: -o DEST (or SRC DEST)"),
    ],
)
def test_a_verb_without_its_output_says_how_to_name_it(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == EXIT_CONFIG
    assert message in capsys.readouterr().err


def test_convert_help_gives_the_positional_dest_as_the_docs_write_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The docs write `convert SRC DEST`; --help called DEST an older spelling (#49)."""
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "DEST output folder or fsspec URL (or -o DEST: the same)" in text
    assert "older spelling of -o" not in text


def _at_a_terminal(argv: list[str], env: dict[str, str]) -> str:
    """What `python -m hpctrain ARGV` writes to a terminal (a pseudo-terminal as its stdout
    and stderr)."""
    import pty

    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain", *argv], stdout=follower, stderr=follower, env=env
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # EIO: the process closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    os.close(leader)
    proc.wait(timeout=120)
    return b"".join(chunks).decode().replace("\r\n", "\n")


@pytest.mark.slow  # three interpreters that import torch: ~12 s
def test_a_slow_starting_verb_says_so_at_once_at_a_terminal_only(tmp_path: Path) -> None:
    argv = ["export", str(tmp_path / "no-run"), "--out", str(tmp_path / "out.pt")]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    lines = _at_a_terminal(argv, env).splitlines()
    assert lines[0].startswith("hpctrain: export: loading torch and the trainer"), lines
    assert any(line.startswith("hpctrain export: ") for line in lines[1:]), lines  # its error
    # a pipe (a SLURM log, a test) and each rank of a multi-process run say nothing of it
    piped = subprocess.run(
        [sys.executable, "-m", "hpctrain", *argv], capture_output=True, text=True, env=env
    )
    assert "loading torch" not in piped.stdout + piped.stderr and piped.returncode != 0
    ranked = ["eval", str(tmp_path / "no-run")]  # eval's error line names its rank
    rank = _at_a_terminal(ranked, {**env, "RANK": "1", "WORLD_SIZE": "2"})
    assert "loading torch" not in rank and "hpctrain eval [rank 1]: " in rank, rank
