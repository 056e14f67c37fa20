"""sentencepiece `tokenizer.model` and tiktoken `*.tiktoken` tokenizers, made here: load, convert
text, train 3 steps, generate, and the check against a run's `data.tokenizer`."""

from __future__ import annotations

import base64
import random
from pathlib import Path

import pytest

from hpctrain.config import ConfigError, load_config
from hpctrain.convert.run import ConvertOptions, convert
from hpctrain.data.index import read_index
from hpctrain.data.tokenizer import (
    SENTENCEPIECE,
    TIKTOKEN,
    TokenizerError,
    file_kind,
    load_tokenizer,
)

WORDS = ("the", "cat", "dog", "sat", "ran", "on", "under", "a", "mat", "log", "and", "slept")


def sentences(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 12))) + "." for _ in range(num)
    ]


def make_sentencepiece(folder: Path) -> Path:
    """A byte-fallback BPE sentencepiece model trained on `sentences` (EOS `</s>` = id 2)."""
    spm = pytest.importorskip("sentencepiece")
    prefix = folder / "tokenizer"
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(sentences(200)),
        model_prefix=str(prefix),
        vocab_size=300,  # 3 specials + 256 byte pieces + merges
        model_type="bpe",
        byte_fallback=True,
        minloglevel=2,
    )
    return prefix.with_suffix(".model")


def make_tiktoken(path: Path, merges: tuple[bytes, ...] = (b"th", b"the", b" c", b"at")) -> Path:
    """Every byte, then `merges`, as tiktoken's `base64 rank` lines."""
    tokens = [bytes([b]) for b in range(256)] + list(merges)
    path.write_text("".join(f"{base64.b64encode(t).decode()} {r}\n" for r, t in enumerate(tokens)))
    return path


def test_sentencepiece_round_trip_eod_and_controls(tmp_path: Path) -> None:
    path = make_sentencepiece(tmp_path)
    tok = load_tokenizer(str(path))
    assert tok.kind == SENTENCEPIECE and file_kind(str(path)) == SENTENCEPIECE
    assert tok.info()["vocab_size"] == 300 and tok.eod_id == 2 and len(tok.sha256) == 64
    text = "the cat sat </s> ✓"  # the EOS's text is ordinary text; bytes fall back
    ids = tok.encode(text)
    assert tok.eod_id not in ids and tok.decode([*ids, tok.eod_id]) == text
    assert load_tokenizer(str(path), eod_token="<s>").eod_id == 1  # another control piece
    with pytest.raises(TokenizerError, match=r"'▁the' is an ordinary piece .* </s>, <s>"):
        load_tokenizer(str(path), eod_token="▁the")
    broken = tmp_path / "broken.model"
    broken.write_bytes(b"\x0a\x03abc not a model")
    with pytest.raises(TokenizerError, match=rf"{broken}: not a readable sentencepiece"):
        load_tokenizer(str(broken))


def test_tiktoken_round_trip_and_its_appended_eod(tmp_path: Path) -> None:
    pytest.importorskip("tiktoken")
    path = make_tiktoken(tmp_path / "tiny.tiktoken")
    tok = load_tokenizer(str(path))
    assert tok.kind == TIKTOKEN and (tok.vocab_size, tok.eod_id) == (261, 260)
    text = "the cat <|endoftext|> ✓"  # the EOD's text inside a document is ordinary text
    ids = tok.encode(text)
    assert ids[:3] == [257, 258, 259] and 260 not in ids
    assert tok.decode([*ids, 260]) == text
    # --eod-token names it (same id); a Llama-3-like tokenizer.model is read as tiktoken too
    assert load_tokenizer(str(path), eod_token="<|end_of_text|>").eod_id == 260
    llama = tmp_path / "tokenizer.model"
    llama.write_bytes(path.read_bytes())
    assert load_tokenizer(str(llama)).kind == TIKTOKEN
    bad = tmp_path / "bad.tiktoken"
    bad.write_text("IQ== 0\nnot-base64!! x\n")
    with pytest.raises(TokenizerError, match=rf"{bad}:2: not a tiktoken BPE line"):
        load_tokenizer(str(bad))
    bad.write_text("IQ== 0\n")  # "!" alone: the other 255 bytes are missing
    with pytest.raises(TokenizerError, match="255 of the 256 single bytes"):
        load_tokenizer(str(bad))


def train_overrides(index: Path, run_dir: Path, tokenizer: str, *extra: str) -> list[str]:
    return [
        f"run_dir={run_dir}",
        "task=causal_lm",
        f"data.train={index}",
        "data.val=",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=16",
        "data.batch_size=4",
        "data.workers_per_rank=0",
        "causal_lm.dim=32",
        "causal_lm.n_layers=2",
        "causal_lm.n_heads=4",
        "train.max_steps=3",
        "train.warmup_steps=0",
        "train.precision=fp32",
        "checkpoint.every_steps=3",
        "logging.progress=lines",
        *extra,
    ]


@pytest.mark.parametrize("kind", [SENTENCEPIECE, TIKTOKEN])
def test_convert_train_and_generate_with_the_file(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from hpctrain.cli.main import main
    from hpctrain.inference.generate import generate_text
    from tests.train.test_trainer import build

    if kind == SENTENCEPIECE:
        path = make_sentencepiece(tmp_path)
    else:
        pytest.importorskip("tiktoken")
        path = make_tiktoken(tmp_path / "words.tiktoken")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sentences(80, seed=1)) + "\n")
    dest = tmp_path / "tokens"
    args = [str(corpus), str(dest), "--tokenizer", str(path), "--text-per-line"]
    assert main(["convert", *args, "--progress", "none"]) == 0
    index = read_index(str(dest / "index.json"))
    tok = load_tokenizer(str(path))
    assert index.tokenizer == tok.info()  # name, vocab_size, eod_id and the file's sha256
    assert main(["inspect", str(dest), "--verify"]) == 0
    assert f"eod_id {tok.eod_id}" in capsys.readouterr().out

    run_dir = tmp_path / "run"
    trainer = build(load_config(None, train_overrides(dest / "index.json", run_dir, str(path))))
    assert trainer.fit() == 0
    text = generate_text(str(run_dir), "the cat", max_new_tokens=6, device="cpu")
    assert text.startswith("the cat") and len(text) > len("the cat")
    assert tok.encode(text[len("the cat") :])  # decoded by the same tokenizer: its own text

    # another file of the same kind: refused before any work, naming both files
    if kind == SENTENCEPIECE:
        other = tmp_path / "other" / "tokenizer.model"
        other.parent.mkdir()
        other.write_bytes(path.read_bytes() + b"\n")  # not the same bytes: another sha256
    else:
        other = make_tiktoken(tmp_path / "other.tiktoken", merges=(b"ca",))
    with pytest.raises(ConfigError) as info:
        build(load_config(None, train_overrides(dest / "index.json", tmp_path / "r2", str(other))))
    message = str(info.value)
    assert f"data.tokenizer = '{other}'" in message and f"'{path}'" in message
    assert tok.sha256[:12] in message and not (tmp_path / "r2").exists()


def test_convert_names_a_missing_library_or_file(tmp_path: Path) -> None:
    corpus = tmp_path / "a.txt"
    corpus.write_text("hello\n")
    with pytest.raises(TokenizerError, match=r"'gone.tiktoken': no such file"):
        convert(ConvertOptions(str(corpus), str(tmp_path / "o"), tokenizer="gone.tiktoken"))
