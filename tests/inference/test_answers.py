"""Answers scored: `eval.generate` in training (rising, ranking checkpoints, plotted), under
DDP/FSDP2/HSDP/TP, and `hpctrain eval --data FILE.jsonl` with its predictions."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from hpctrain.cli.main import main
from hpctrain.config import ConfigError, load_config
from hpctrain.observe.plot import plot_run
from hpctrain.tasks.task import load_task
from tests.support.answer_kit import qa_overrides, write_qa
from tests.support.lm_kit import write_token_shards
from tests.support.train_kit import REPO, run_two_ranks

WORKER = REPO / "tests" / "support" / "answer_worker.py"


def evals(run_dir: Path) -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == "eval"]


@pytest.mark.slow
def test_exact_match_rises_ranks_checkpoints_and_is_plotted(qa_run: Path) -> None:
    records = evals(qa_run)
    scores = [r["val_exact_match"] for r in records]
    assert [r["step"] for r in records] == [20, 40, 60]
    assert 0 < scores[0] < 0.5 < max(scores), scores  # a quarter by chance, then learnt
    assert all(r["val_answers"] == 30 for r in records)  # eval.generate_samples
    assert all(r["val_token_f1"] >= r["val_exact_match"] for r in records)
    best = (qa_run / "checkpoints" / "best").read_text().strip()
    first_best = records[scores.index(max(scores))]["step"]
    assert best.endswith(f"step-{first_best}")  # checkpoint.monitor=val_exact_match
    assert qa_run / "answers.png" in plot_run(qa_run)


@pytest.mark.slow
@pytest.mark.distributed
def test_ddp_fsdp2_hsdp_and_tp_answer_as_one_process_does(qa_run: Path, tmp_path: Path) -> None:
    """Each rank answers its share, the counts summed once: the same scores as the run's own
    evaluation of the checkpoint, with every prompt answered once."""
    partial = evals(qa_run)[0]  # step 20: some answers right, most wrong
    qa = tmp_path / "held-out.jsonl"
    write_qa(qa, 9, seed=11)
    checkpoint = qa_run / "checkpoints" / "step-20"
    run_two_ranks(WORKER, str(qa_run.parent / "tokens"), str(checkpoint), str(qa), str(tmp_path))
    for case in ("ddp", "fsdp", "hsdp", "tp"):
        (record,) = evals(tmp_path / case)
        for key in ("val_exact_match", "val_token_f1", "val_answers"):
            assert record[key] == pytest.approx(partial[key], abs=1e-9), (case, key)
    from hpctrain.inference.generate import load_gpt
    from hpctrain.models.decoding import decode

    plain = load_gpt(str(checkpoint)).model
    for name in ("fsdp-window-0", "fsdp-window-1", "tp-window-0", "tp-window-1"):
        rows = json.loads((tmp_path / f"{name}.json").read_text())  # decoded in lockstep
        for prompt, row in zip(rows["prompts"], rows["rows"], strict=True):
            assert decode(plain, [prompt], max_new_tokens=20, window=8) == [row], name
    val = json.loads((tmp_path / "val.json").read_text())  # `hpctrain eval` on 2 ranks
    assert val["world_size"] == 2 and val["val_answers"] == 30
    assert val["val_exact_match"] == pytest.approx(partial["val_exact_match"], abs=1e-9)
    held_out = json.loads((tmp_path / "held-out.json").read_text())
    lines = Path(held_out["predictions"]).read_text().splitlines()
    assert held_out["world_size"] == 2 and held_out["val_answers"] == 9 == len(lines)
    assert [json.loads(line)["key"] for line in lines] == [
        f"held-out.jsonl:{n}" for n in range(1, 10)
    ]


@pytest.mark.slow
def test_a_held_out_file_is_scored_with_its_predictions_beside(
    qa_run: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    qa = tmp_path / "qa.jsonl"
    rows = write_qa(qa, 6, seed=5)
    with qa.open("a") as f:
        f.write('{"prompt": "ab\\n"}\n')  # no response: line 7
    args = ["eval", str(qa_run), "--data", str(qa), "--prompt-field", "prompt"]
    assert main(args) == 2  # a usage error: no --response-field
    args += ["--response-field", "response"]
    assert main(args) == 3  # a data error naming the line
    assert f"{qa}:7:" in capsys.readouterr().err
    assert main([*args, "data.on_error=skip"]) == 0
    out, err = capsys.readouterr()
    record = json.loads(out.strip().splitlines()[-1])
    ranks = [line for line in err.splitlines() if " rank 0/1 on " in line]
    assert ranks and all(line.endswith(f", data {qa}") for line in ranks)  # was: "data "
    assert record["records_skipped"] == 1 and record["val_answers"] == 6
    summary = Path(record["record"])
    assert summary.parent == qa_run / "eval" and summary.name.startswith("step-60.qa-")
    predictions = [
        json.loads(line) for line in Path(record["predictions"]).read_text().splitlines()
    ]
    assert Path(record["predictions"]).parent == summary.parent
    assert [p["prompt"] for p in predictions] == [row["prompt"] for row in rows]
    assert [p["reference"] for p in predictions] == [row["response"] for row in rows]
    assert all(p["match"] == (p["answer"] == p["reference"]) for p in predictions)
    matches = [p["match"] for p in predictions]
    assert record["val_exact_match"] == pytest.approx(sum(matches) / 6) and any(matches)


@pytest.mark.slow
def test_answers_near_the_window_do_not_depend_on_the_batch(
    qa_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Prompts of 40 to 63 tokens reach the window (data.seq_len 64) at different steps and
    restart there: each is answered as alone, whatever `eval.generate_batch_size` puts beside
    it. The model: a Llama of large random weights (greedy choices that follow the context,
    never the end of document), one step at lr 0 on the questions' tokens."""
    from tests.models.test_hf import LM_VOCAB, save_hf

    folder = tmp_path / "llama"
    model = save_hf(folder, "llama", vocab_size=LM_VOCAB)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" not in name:
                param.mul_(8)
    model.save_pretrained(folder)
    tokens = qa_run.parent / "tokens"
    run_dir = tmp_path / "run"
    overrides = [
        *(o for o in qa_overrides(tokens, run_dir) if not o.startswith("causal_lm.")),
        f"model.init_from={folder}",
        "train.max_steps=1",
        "train.lr=0",
        "eval.generate=false",
        "checkpoint.every_steps=1",
    ]
    from tests.train.test_trainer import build

    assert build(load_config(None, overrides)).fit() == 0
    rng = random.Random(4)
    qa = tmp_path / "long.jsonl"
    with qa.open("w") as f:
        for length in rng.sample(range(40, 63), 8):
            letters = "".join(rng.choice("abcd") for _ in range(length))
            f.write(json.dumps({"prompt": letters + "\n", "response": letters[0].upper()}) + "\n")
    answers = {}
    for size in (1, 3, 8):
        args = ["eval", str(run_dir), "--data", str(qa), "--prompt-field", "prompt"]
        args += ["--response-field", "response", "--out", str(tmp_path / f"b{size}.json")]
        assert main([*args, f"eval.generate_batch_size={size}", "eval.max_new_tokens=40"]) == 0
        record = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        lines = Path(record["predictions"]).read_text().splitlines()
        answers[size] = [json.loads(line)["answer"] for line in lines]
    assert all(len(answer) > 30 for answer in answers[1])  # past the window, never stopped
    assert answers[3] == answers[1] and answers[8] == answers[1]


@pytest.mark.slow
def test_eval_takes_the_tokenizer_where_it_has_moved(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """#48 item 8: the run's tokenizer file moved away, `eval --data` and `eval --harness`
    say to give `--tokenizer PATH`, and take it (checked by sha256: another one is refused)."""
    import shutil

    from tests.support.finetune_kit import convert_text, save_bpe_folder, train

    tok = save_bpe_folder(tmp_path / "tok", chat_template=False)
    other = save_bpe_folder(tmp_path / "other", seed=5, chat_template=False)
    data = tmp_path / "data"
    convert_text(data / "train", str(tok), seed=1, documents=30)
    convert_text(data / "val", str(tok), seed=2, documents=6)
    run = tmp_path / "run"
    train(run, data, "causal_lm.dim=32", "causal_lm.n_layers=1", "causal_lm.n_heads=2")
    shutil.move(tmp_path / "tok", tmp_path / "moved")
    qa = tmp_path / "qa.jsonl"
    write_qa(qa, 3, seed=1)
    answers = ["eval", str(run), "--data", str(qa), "--prompt-field", "prompt"]
    answers += ["--response-field", "response", "--out", str(tmp_path / "qa.json")]
    harness = ["eval", str(run), "--harness", "letters", "--harness-include", str(tmp_path)]
    harness += ["--out", str(tmp_path / "h.json"), "--limit", "2"]
    (tmp_path / "letters.yaml").write_text(LETTERS_TASK.replace("QA", str(qa)))
    for command in (answers, harness):
        capsys.readouterr()
        assert main(command) == 3
        assert "give that tokenizer with --tokenizer PATH" in capsys.readouterr().err
        assert main([*command, "--tokenizer", str(tmp_path / "moved" / "tokenizer.json")]) == 0
    assert json.loads((tmp_path / "qa.json").read_text())["val_answers"] == 3
    assert main([*answers, "--tokenizer", str(other)]) == 2  # the same check for both
    assert "is not the tokenizer the checkpoint's model was trained on" in capsys.readouterr().err


LETTERS_TASK = """task: letters
dataset_path: json
dataset_kwargs:
  data_files:
    test: QA
test_split: test
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: "{{response}}"
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 2
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow
def test_answer_settings_are_refused_where_they_cannot_work(qa_run: Path, tmp_path: Path) -> None:
    tokens = qa_run.parent / "tokens"
    base = qa_overrides(tokens, tmp_path / "r")
    train = load_config(None, base)
    from hpctrain.data import open_index

    index = open_index(str(tokens / "train" / "index.json"))
    plain = [*base, "eval.generate=false", "checkpoint.monitor=val_exact_match"]
    with pytest.raises(ConfigError, match="needs eval.generate=true"):
        load_task(load_config(None, plain), index)
    with pytest.raises(ConfigError, match="eval.normalize: 'stem'"):
        load_config(None, [*base, "eval.normalize=[case,stem]"])
    plain_val = write_token_shards(tmp_path / "plain", 1, seed=3, tokenizer=index.tokenizer)
    with pytest.raises(ConfigError, match=r"eval.generate=true: data.val=.* holds no prompts"):
        load_task(load_config(None, [*base, f"data.val={plain_val}"]), index)
    assert load_task(train, index).metric_names()[-3:] == (
        "val_exact_match",
        "val_token_f1",
        "val_answers",
    )


@pytest.mark.slow
def test_a_submitted_eval_job_answers_the_file_in_its_task(qa_run: Path, tmp_path: Path) -> None:
    """What `hpctrain submit --eval --data ...` pickles for SLURM, called in this process."""
    from hpctrain.launch.submit import InferenceJob, InferenceSpec

    qa = tmp_path / "qa.jsonl"
    write_qa(qa, 4, seed=8)
    spec = InferenceSpec(
        verb="eval",
        data=str(qa),
        prompt_field="prompt",
        response_field="response",
        out=str(tmp_path / "record.json"),
    )
    cfg = load_config(None, qa_overrides(qa_run.parent / "tokens", qa_run))
    assert InferenceJob(cfg, spec)() == 0
    record = json.loads((tmp_path / "record.json").read_text())
    assert record["val_answers"] == 4 and Path(record["predictions"]).is_file()
