"""lm-evaluation-harness on a run's model, offline: a local multiple-choice task, a local
generation task and a local perplexity task (YAML + JSONL written here) score the same through
hpctrain's model as through the harness's own `hf` model type on the exported Hugging Face
folder, run by the `lm_eval` command line the record gives (standard errors included)."""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from tests.support.answer_kit import LETTERS, qa_rows

lm_eval = pytest.importorskip("lm_eval")

CHOICE_TASK = """task: qa_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: {choices}
doc_to_target: "{{{{label}}}}"
target_delimiter: ""
metric_list:
  - metric: acc
"""
ANSWER_TASK = """task: qa_answer
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{response}}}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 5
  do_sample: false
metric_list:
  - metric: exact_match
"""
TEXT_TASK = """task: qa_text
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{prompt}}}}{{{{response}}}}"
metric_list:
  - metric: word_perplexity
  - metric: bits_per_byte
"""
CHOICES = [f"{letter.upper()}." for letter in LETTERS]
TASKS = ["qa_choice", "qa_answer", "qa_text"]


def write_tasks(folder: Path) -> Path:
    """The two task YAML files and their JSONL data under `folder`."""
    folder.mkdir()
    rows = qa_rows(24, seed=21)
    for row in rows:
        row["label"] = CHOICES.index(row["response"])
    data = folder / "qa.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / "qa_choice.yaml").write_text(CHOICE_TASK.format(data=data, choices=CHOICES))
    (folder / "qa_answer.yaml").write_text(ANSWER_TASK.format(data=data))
    (folder / "qa_text.yaml").write_text(TEXT_TASK.format(data=data))
    return folder


@pytest.mark.slow
def test_the_harness_scores_the_run_as_it_scores_the_exported_folder(
    qa_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tasks = write_tasks(tmp_path / "tasks")
    args = ["--harness", ",".join(TASKS), "--harness-include", str(tasks)]
    assert main(["eval", str(qa_run), *args, "--num-fewshot", "0"]) == 0
    record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    name = "harness-qa_choice,qa_answer,qa_text-step-60.json"
    assert Path(record["record"]) == qa_run / "eval" / name
    ours = record["results"]
    assert ours["qa_choice"]["acc,none"] > 0.5 and ours["qa_answer"]["exact_match,none"] > 0.5
    assert record["max_length"] == 64  # data.seq_len, not the export's context (128)
    for task, metric in (("qa_choice", "acc"), ("qa_answer", "exact_match")):
        assert isinstance(ours[task][f"{metric}_stderr,none"], float)  # as lm-eval prints it
    # the command the record gives, on the exported folder: lm-eval's own command line
    out = tmp_path / "exported"
    assert main(["export", str(qa_run), str(out), "--format", "hf"]) == 0
    command = shlex.split(record["lm_eval_command"].replace("pretrained=OUT", f"pretrained={out}"))
    assert command[:3] == ["lm_eval", "--model", "hf"]
    from lm_eval.__main__ import cli_evaluate  # `lm_eval`'s entry point, in this process

    monkeypatch.setattr(sys, "argv", [*command, "--output_path", str(tmp_path / "lm")])
    cli_evaluate()
    (written,) = (tmp_path / "lm").rglob("results_*.json")
    theirs = json.loads(written.read_text())["results"]
    for key in ("acc,none", "acc_stderr,none"):
        assert ours["qa_choice"][key] == pytest.approx(theirs["qa_choice"][key], rel=1e-9)
    for key in ("exact_match,none", "exact_match_stderr,none"):
        assert ours["qa_answer"][key] == pytest.approx(theirs["qa_answer"][key], rel=1e-9)
    for metric in ("word_perplexity,none", "bits_per_byte,none"):  # sums of log-probabilities
        assert ours["qa_text"][metric] == pytest.approx(theirs["qa_text"][metric], rel=1e-5)


@pytest.mark.slow
def test_a_task_that_needs_the_internet_fails_in_one_line(
    qa_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["eval", str(qa_run), "--harness", "arc_easy"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Couldn't reach 'allenai/ai2_arc'" in err[0]
    assert "--harness-include DIR" in err[0]
    assert main(["eval", str(qa_run), "--harness", "no_such_task"]) == 2
    assert "not a task of lm-evaluation-harness" in capsys.readouterr().err
