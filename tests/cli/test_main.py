"""`hpctrain --help` and every verb's `--help` work and show an example."""

import subprocess
import sys

import pytest

from hpctrain.cli.main import VERBS, build_parser, main, requested_verb


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
