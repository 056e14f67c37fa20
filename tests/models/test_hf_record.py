"""What a run started from a Hugging Face folder records, and that every later verb uses the
record: resume, eval, export and generate never read the folder again (issue #37 items 2, 5,
7, 10, 11, 15, 16, 17). Tiny transformers-made folders (hidden 32, 2 layers, vocab 300), a
BPE tokenizer trained here on a few KB, one process."""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from hpctrain.checkpoint.weights import locate_checkpoint
from hpctrain.cli.main import main
from hpctrain.config import ConfigError
from hpctrain.data.tokenizer import file_sha256
from hpctrain.errors import DataError, UsageError
from hpctrain.models import hf
from tests.models.test_hf import LLAMA3_ROPE, save_hf
from tests.support.finetune_kit import (
    SEQ_LEN,
    VOCAB,
    convert_text,
    eval_records,
    save_bpe_folder,
    save_metaspace_tokenizer,
    tokens,
    train,
    trainer,
)

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytestmark = pytest.mark.slow  # each case trains a run or two: seconds


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ROOT/tok (a BPE tokenizer folder with a chat template) and ROOT/data/{train,val}
    converted with it, the tokenizer named by a relative path from ROOT (as a user types it)."""
    root = tmp_path_factory.mktemp("bpe")
    save_bpe_folder(root / "tok")
    here = Path.cwd()
    os.chdir(root)
    try:
        convert_text(root / "data" / "train", "tok/tokenizer.json", seed=1, documents=30)
        convert_text(root / "data" / "val", "tok/tokenizer.json", seed=2, documents=6)
    finally:
        os.chdir(here)
    return root


def hf_folder(path: Path, kind: str, bpe: Path, **extra: Any) -> Any:
    """A transformers-made folder of vocabulary `VOCAB`, holding the run's tokenizer.json."""
    model = save_hf(path, kind, vocab_size=VOCAB, **extra)
    shutil.copy(bpe / "tok" / "tokenizer.json", path / "tokenizer.json")
    return model


def test_convert_stores_the_tokenizer_path_absolute(bpe: Path) -> None:
    """Item 11: `--tokenizer tok/tokenizer.json` from ROOT is stored as ROOT/tok/tokenizer.json,
    so that export and generate find it from any folder."""
    index = json.loads((bpe / "data" / "train" / "index.json").read_text())
    assert index["tokenizer"]["name"] == str(bpe / "tok" / "tokenizer.json")
    assert index["tokenizer"]["sha256"] == file_sha256(str(bpe / "tok" / "tokenizer.json"))


def edit_config(folder: Path, **changes: Any) -> None:
    config = json.loads((folder / hf.CONFIG).read_text())
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in changes and "rope_theta" in rope:
        rope["rope_theta"] = changes.pop("rope_theta")
    config.update(changes)
    (folder / hf.CONFIG).write_text(json.dumps(config))


def test_a_changed_or_removed_folder_changes_nothing(
    bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 2: eval of a checkpoint after the folder's config.json changed gives the run's own
    validation loss; a resume, an export and generate work with the folder gone, from the
    shape the checkpoint records."""
    folder = tmp_path / "llama"
    hf_folder(folder, "llama", bpe, rope_scaling=LLAMA3_ROPE, rms_norm_eps=1e-5)
    run = tmp_path / "run"
    start = f"model.init_from={folder}"
    first = train(run, bpe / "data", start, "train.max_steps=2", "train.lr=0.01")
    recorded = first.task.model_cfg
    last = eval_records(run)[-1]["val_loss"]
    # a new revision downloaded to the same place: another RoPE base and norm epsilon
    edit_config(folder, rope_theta=10000.0, rms_norm_eps=1e-2)
    record = tmp_path / "eval.json"
    capsys.readouterr()
    assert main(["eval", str(run), "--out", str(record)]) == 0
    assert json.loads(record.read_text())["val_loss"] == pytest.approx(last, rel=1e-6)
    capsys.readouterr()
    resumed = train(run, bpe / "data", start, "train.max_steps=3", "train.lr=0.01")
    assert resumed.task.model_cfg == recorded and resumed.state.step == 3
    # (eval's start-up logs to stderr from here on, as every verb does)
    assert "its config.json is not what the run started from" in capsys.readouterr().err
    folder.rename(tmp_path / "moved")  # the folder is gone: nothing needs it
    resumed = train(run, bpe / "data", start, "train.max_steps=4", "train.lr=0.01")
    assert resumed.task.model_cfg == recorded and resumed.state.step == 4
    out = tmp_path / "exported"
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    config = json.loads((out / hf.CONFIG).read_text())
    assert config["rope_theta"] == 500000.0 and config["rms_norm_eps"] == 1e-5
    assert config["rope_scaling"]["factor"] == 8.0
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "the cat", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out.startswith("the cat")


def test_an_older_checkpoint_reads_the_folder_with_a_note(
    bpe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Checkpoints saved before the record: export reads the folder as before, and says so."""
    folder = tmp_path / "qwen2"
    hf_folder(folder, "qwen2", bpe)
    run = tmp_path / "run"
    train(run, bpe / "data", f"model.init_from={folder}")
    _, name, manifest = locate_checkpoint(str(run))
    for key in ("gpt", "hf_config", "tokenizer"):
        del manifest["metadata"][key]
    (run / "checkpoints" / name / "manifest.json").write_text(json.dumps(manifest))
    with caplog.at_level(logging.INFO):
        assert main(["export", str(run), str(tmp_path / "out"), "--format", "hf"]) == 0
    assert "records no model shape (an older hpctrain saved it)" in caplog.text
    config = json.loads((tmp_path / "out" / hf.CONFIG).read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]


@pytest.fixture(scope="module")
def mistral_run(bpe: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Any]:
    """(source folder, run, transformers model): a Mistral of window `SEQ_LEN` (the longest
    the run may train at), one step at lr 0, its tokens from the `bpe` folder's tokenizer."""
    root = tmp_path_factory.mktemp("mistral")
    folder = root / "mistral"
    model = hf_folder(folder, "mistral", bpe, sliding_window=SEQ_LEN)
    run = root / "run"
    train(run, bpe / "data", f"model.init_from={folder}")
    return folder, run, model


def test_a_mistral_export_keeps_its_sliding_window(mistral_run: tuple, tmp_path: Path) -> None:
    """Item 7: transformers attends within the window on the export as on the source (logits
    equal past the window; with `sliding_window: null` they differ)."""
    _, run, source = mistral_run
    out = tmp_path / "exported"
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    assert json.loads((out / hf.CONFIG).read_text())["sliding_window"] == SEQ_LEN
    exported = transformers.AutoModelForCausalLM.from_pretrained(out).float().eval()
    longer = tokens(2 * SEQ_LEN)  # past the window: the window decides the logits
    with torch.no_grad():
        expected = source(longer).logits
        torch.testing.assert_close(exported(longer).logits, expected, rtol=0, atol=1e-5)
        exported.config.sliding_window = None  # what the export wrote before: it differs
        assert (exported(longer).logits - expected).abs().max() > 1e-3


def test_an_export_carries_the_chat_template_and_the_models_context(
    bpe: Path, mistral_run: tuple, tmp_path: Path
) -> None:
    """Item 10: every tokenizer file transformers reads comes along; `apply_chat_template`
    works on the export as on the source folder; `model_max_length` is the model's context
    (max_position_embeddings), not the training data.seq_len."""
    _, run, _ = mistral_run
    out = tmp_path / "exported"
    assert main(["export", str(run), str(out), "--format", "hf"]) == 0
    for name in ("chat_template.jinja", "special_tokens_map.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (bpe / "tok" / name).read_bytes(), name
    messages = [{"role": "user", "content": "the cat"}, {"role": "assistant", "content": "sat"}]
    source = transformers.AutoTokenizer.from_pretrained(bpe / "tok")
    exported = transformers.AutoTokenizer.from_pretrained(out)
    rendered = exported.apply_chat_template(messages, tokenize=False)
    assert rendered == source.apply_chat_template(messages, tokenize=False)
    assert rendered.startswith("<|im_start|>user\nthe cat<|im_end|>")
    config = json.loads((out / hf.CONFIG).read_text())
    assert exported.model_max_length == config["max_position_embeddings"] == 128 > SEQ_LEN
    assert exported.eos_token == "<|im_end|>"  # the source folder's


def test_an_export_whose_tokenizer_transformers_loads_otherwise_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """#48 item 7: transformers 5 loads its own Qwen2Tokenizer for any qwen2 folder, which
    drops a sentencepiece-style tokenizer's spaces and newlines: the export checks what
    AutoTokenizer encodes, warns once naming the fix, and writes OUT/tokenizer (the files
    alone), which loads right. A Llama folder with the same tokenizer: nothing to say."""
    import tokenizers

    tok = save_metaspace_tokenizer(tmp_path / "tok")
    data = tmp_path / "data"
    convert_text(data / "train", str(tok), seed=1, documents=30)
    convert_text(data / "val", str(tok), seed=2, documents=6)
    exports = {}
    for kind in ("qwen2", "llama"):
        save_hf(tmp_path / kind, kind, vocab_size=VOCAB)
        train(tmp_path / f"run-{kind}", data, f"model.init_from={tmp_path / kind}")
        out = tmp_path / f"out-{kind}"
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="hpctrain"):
            assert main(["export", str(tmp_path / f"run-{kind}"), str(out), "--format", "hf"]) == 0
        exports[kind] = (
            out,
            [r.getMessage() for r in caplog.records if "AutoTokenizer" in r.getMessage()],
        )
    out, warnings = exports["qwen2"]
    (warning,) = warnings
    assert "Qwen2Tokenizer encodes 'The cat sat on the mat." in warning
    assert "catsatonthemat" in warning  # its ids, decoded: the spaces are gone
    assert f"--model_args pretrained={out},tokenizer={out / 'tokenizer'}" in warning
    text = "the cat\n sat  on a log, 3 times"
    fixed = transformers.AutoTokenizer.from_pretrained(out / "tokenizer")
    ours = tokenizers.Tokenizer.from_file(str(tok)).encode(text).ids
    assert fixed(text, add_special_tokens=False)["input_ids"] == ours
    plain = transformers.AutoTokenizer.from_pretrained(out)
    assert plain(text, add_special_tokens=False)["input_ids"] != ours  # transformers' own
    out, warnings = exports["llama"]
    assert warnings == [] and not (out / "tokenizer").exists()


def test_export_and_generate_work_from_another_folder(
    mistral_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 11: the tokenizer the checkpoint records is found from anywhere."""
    _, run, _ = mistral_run
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert main(["export", str(run), "hf-model", "--format", "hf"]) == 0
    assert (elsewhere / "hf-model" / "tokenizer.json").is_file()
    assert main(["generate", str(run), "--prompt", "the", "--max-new-tokens", "2"]) == 0


def test_export_onto_links_and_the_current_folder(
    mistral_run: tuple, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Item 16: a link to an empty folder gets the export in that folder; `.`, `./` and a
    link to a folder with files are one line each, and nothing of the user's goes."""
    _, run, _ = mistral_run
    target = tmp_path / "target"
    target.mkdir()
    link = tmp_path / "link"
    link.symlink_to(target)
    assert main(["export", str(run), str(link), "--format", "hf"]) == 0
    assert link.is_symlink() and (target / hf.CONFIG).is_file()
    here = tmp_path / "here"
    here.mkdir()
    (here / "notes.txt").write_text("mine")
    monkeypatch.chdir(here)
    for out in (".", "./", str(link)):
        with pytest.raises(UsageError) as info:
            from hpctrain.inference.export import export_hf

            export_hf(str(run), out)
        assert "\n" not in str(info.value)
    assert main(["export", str(run), ".", "--format", "hf"]) == 2
    assert main(["export", str(run), ".", "--format", "safetensors"]) == 2  # a folder
    assert sorted(os.listdir(here)) == ["notes.txt"]
    assert (target / hf.CONFIG).is_file()


def test_data_of_another_tokenizer_is_refused_by_every_verb(
    bpe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Item 5: data.train re-converted in place with another tokenizer of the same size: a
    resume, eval, and a warm start from the run refuse it in one line naming both; export and
    generate use the recorded tokenizer, and refuse another one."""
    tok_a = save_bpe_folder(tmp_path / "tok-a", chat_template=False)
    tok_b = save_bpe_folder(tmp_path / "tok-b", seed=5, chat_template=False)
    assert file_sha256(str(tok_a)) != file_sha256(str(tok_b))
    data = tmp_path / "data"
    convert_text(data / "train", str(tok_a), seed=1, documents=30)
    convert_text(data / "val", str(tok_a), seed=2, documents=6)
    run = tmp_path / "run"
    tiny = ("causal_lm.dim=32", "causal_lm.n_layers=2", "causal_lm.n_heads=4")
    train(run, data, *tiny)
    convert_text(data / "train", str(tok_b), seed=1, documents=30)  # in place
    convert_text(data / "val", str(tok_b), seed=2, documents=6)
    both = rf"sha256 {file_sha256(str(tok_b))[:12]}.*sha256 {file_sha256(str(tok_a))[:12]}"
    with pytest.raises(DataError, match=rf"^data.train=\S+: converted with .*{both}") as info:
        trainer(run, data, *tiny, "train.max_steps=2")
    assert "\n" not in str(info.value)
    capsys.readouterr()
    assert main(["eval", str(run)]) == 3
    assert "the same ids would stand for other tokens" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=rf"^data.train=.*{both}"):
        trainer(tmp_path / "warm", data, f"model.init_from={run}")
    # export ships the tokenizer the model was trained on, not the data's new one
    assert main(["export", str(run), str(tmp_path / "out"), "--format", "hf"]) == 0
    assert file_sha256(str(tmp_path / "out" / "tokenizer.json")) == file_sha256(str(tok_a))
    keep = tmp_path / "tok-a-copy.json"
    shutil.copy(tok_a, keep)
    shutil.copy(tok_b, tok_a)  # the recorded file replaced in place too
    capsys.readouterr()
    assert main(["export", str(run), str(tmp_path / "out2"), "--format", "hf"]) == 3
    err = capsys.readouterr().err
    assert "is another file now" in err and "--tokenizer PATH" in err
    assert main(["generate", str(run), "--prompt", "the"]) == 3
    wrong = ["export", str(run), str(tmp_path / "out3"), "--format", "hf", "--tokenizer"]
    assert main([*wrong, str(tok_b)]) == 2  # not the model's tokenizer
    assert main([*wrong, str(keep)]) == 0
    assert main(["generate", str(run), "--prompt", "the", "--tokenizer", str(keep)]) == 0


def test_a_preset_is_refused_where_the_folder_sets_another_shape(
    bpe: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 15: `model.name=gpt-1b` with a 32-wide folder is refused; a preset of the
    folder's own shape is said to change nothing."""
    small = tmp_path / "small"
    hf_folder(small, "llama", bpe)
    with pytest.raises(ConfigError, match=r"^model.name=gpt-1b \(dim 2048, .*\) disagrees with"):
        trainer(tmp_path / "r1", bpe / "data", f"model.init_from={small}", "model.name=gpt-1b")
    tiny = tmp_path / "tiny"  # gpt-tiny's shape: dim 128, 4 layers, 4 heads, SwiGLU 352, tied
    shape = {"hidden_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4}
    shape |= {"num_key_value_heads": 4, "intermediate_size": 352, "tie_word_embeddings": True}
    hf_folder(tiny, "llama", bpe, **shape)
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        trainer(tmp_path / "r2", bpe / "data", f"model.init_from={tiny}", "model.name=gpt-tiny")
    assert "model.name=gpt-tiny: the shape is that of" in caplog.text


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"rope_scaling": {k: v for k, v in LLAMA3_ROPE.items() if k != "low_freq_factor"}},
            r"config.json has no rope_scaling.low_freq_factor \(rope_type llama3 needs",
        ),
        ({"hidden_size": None}, r"config.json has no hidden_size$"),
        ({"rope_scaling": "yes"}, r"config.json: rope_scaling is 'yes', not an object$"),
        ({"num_hidden_layers": "two"}, r"config.json: num_hidden_layers is 'two', not a number$"),
        ({"num_attention_heads": 5}, r"config.json gives a shape the GPT cannot take"),
    ],
    ids=["llama3-without-low_freq_factor", "no-hidden_size", "rope-not-an-object", "text", "heads"],
)
def test_a_malformed_config_json_is_one_line_naming_folder_file_and_key(
    tmp_path: Path, change: dict, message: str
) -> None:
    """Item 17 (was a KeyError traceback)."""
    config = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "rope_theta": 500000.0,
    }
    config.update(change)
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / hf.CONFIG).write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=message) as info:
        hf.open_folder(str(tmp_path))
    assert str(info.value).startswith(f"model.init_from={tmp_path}: ")
    assert "\n" not in str(info.value)
