"""Instruction data (`hpctrain convert --prompt-field/--response-field/--messages-field`): one
document per record with a loss mask stored beside the ids, counted and verified."""

from __future__ import annotations

import dataclasses
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from hpctrain.convert.instructions import RecordFormat, encode_record
from hpctrain.convert.run import ConvertOptions, convert
from hpctrain.convert.sources import ConvertError, ConvertOptionError
from hpctrain.convert.verify import format_report, inspect_dataset
from hpctrain.data.index import index_to_bytes, read_index
from hpctrain.data.tokenizer import load_tokenizer
from hpctrain.data.tokens import LOSS_MASK_FIELD, decode_loss_mask, decode_tokens
from tests.support.instruction_kit import EOD, RESPONSE, expected_mask, write_instructions

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi <|im_start|>"},  # a special token's text is only text
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
    {"role": "assistant", "content": "Ciao."},
]


def samples_of(index_path: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of every sample, in shard order; the mask member must come first."""
    index = read_index(str(index_path))
    out = []
    for i in range(len(index.shards)):
        with tarfile.open(index.shard_url(i)) as tar:
            members = tar.getmembers()
            for mask_member, ids_member in zip(members[::2], members[1::2], strict=True):
                assert mask_member.name.endswith(LOSS_MASK_FIELD)
                ids = decode_tokens(tar.extractfile(ids_member).read(), "tokens.u16")  # type: ignore[union-attr]
                data = tar.extractfile(mask_member).read()  # type: ignore[union-attr]
                out.append((ids.astype(np.int64), decode_loss_mask(data, ids.size)))
    return out


def test_prompt_response_masks_the_responses_and_their_eod(tmp_path: Path) -> None:
    rows = write_instructions(tmp_path / "sft.jsonl", 40)
    dest = tmp_path / "out"
    options = ConvertOptions(
        str(tmp_path / "sft.jsonl"),
        str(dest),
        tokenizer="bytes",
        prompt_field="prompt",
        response_field="response",
        sample_tokens=64,
        samples_per_shard=3,
        progress="none",
    )
    index = convert(options).indexes[""]
    num_tokens = sum(len(r["prompt"]) + len(RESPONSE) + 1 for r in rows)
    num_targets = len(rows) * (len(RESPONSE) + 1)
    assert (index.num_tokens, index.num_targets) == (num_tokens, num_targets)
    assert len(index.shards) > 1 and all(s.num_targets for s in index.shards)
    # the fraction of targets is the responses' share of the tokens
    assert index.num_targets / num_tokens == pytest.approx(
        sum(len(RESPONSE) + 1 for _ in rows) / num_tokens
    )
    documents = []
    for ids, mask in samples_of(dest / "index.json"):
        assert np.array_equal(mask, expected_mask(ids))
        documents += np.split(ids, np.flatnonzero(ids == EOD)[:-1] + 1)
    texts = [bytes(d[:-1].astype(np.uint8)).decode() for d in documents]
    assert texts == [r["prompt"] + r["response"] for r in rows]  # one document per record
    assert "--prompt-field prompt --response-field response" in index.command
    assert index.extra["prompt_field"] == "prompt"

    # worker processes write the same bytes
    two = convert(dataclasses.replace(options, dest=str(tmp_path / "two"), workers=2))
    assert [s.sha256 for s in two.indexes[""].shards] == [s.sha256 for s in index.shards]

    report = inspect_dataset(str(dest), verify=True)[0]
    assert not report.errors and report.num_targets == num_targets
    assert f"targets: {num_targets} tokens" in format_report(report)
    # an index whose count is not its shards' is a problem inspect names
    shard = index.shards[0]
    changed = type(shard)(**{**shard.__dict__, "num_targets": shard.num_targets - 1})  # type: ignore[operator]
    wrong = type(index)(**{**index.__dict__, "shards": (changed, *index.shards[1:])})
    (dest / "index.json").write_bytes(index_to_bytes(wrong))
    errors = inspect_dataset(str(dest))[0].errors
    assert any("target tokens in its loss masks, index says" in e for e in errors), errors


def test_chat_records_with_a_jinja_template_mark_only_assistant_turns(tmp_path: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    pytest.importorskip("jinja2")
    folder = tmp_path / "tok"
    folder.mkdir()
    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=280,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([m["content"] for m in CHAT] * 5, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))
    config = {"chat_template": CHATML, "eos_token": "<|im_end|>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHAT}) + "\n")
    dest = tmp_path / "out"
    options = ConvertOptions(
        str(tmp_path / "chat.jsonl"),
        str(dest),
        tokenizer=str(folder / "tokenizer.json"),
        messages_field="messages",
        progress="none",
    )
    index = convert(options).indexes[""]
    assert index.extra["chat_template"] == str(folder / "tokenizer_config.json")
    (ids, mask), *_ = samples_of(dest / "index.json")
    tokenizer = load_tokenizer(str(folder / "tokenizer.json"))
    start, end = tokenizer.specials["<|im_start|>"], tokenizer.specials["<|im_end|>"]
    assert (ids == start).sum() == 5  # the template's, each its special id; the user's is text
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    assert tokenizer.decode(ids) == rendered.replace("<|im_start|>", "").replace(
        "<|im_end|>", ""
    ).replace("Hi ", "Hi <|im_start|>")  # decode leaves the special ids out
    # the targets: each assistant content, its <|im_end|> and newline, and the EOD
    target_text = tokenizer.decode(ids[mask])
    assert target_text == "Hello.\nCiao.\n" and mask[-1] and ids[-1] == tokenizer.eod_id
    assert (ids[mask] == end).sum() == 2 and index.num_targets == int(mask.sum())


def test_the_plain_template_without_a_chat_template() -> None:
    ids, mask = encode_record(
        {"m": CHAT[1:3]}, RecordFormat(messages_field="m"), load_tokenizer("bytes")
    )
    text = bytes(ids[:-1].astype(np.uint8)).decode()
    assert text == "<|user|>\nHi <|im_start|>\n<|assistant|>\nHello.\n"
    assert bytes(ids[mask][:-1].astype(np.uint8)).decode() == "Hello.\n" and mask[-1]
    ids, mask = encode_record(
        {"m": CHAT[:2]}, RecordFormat(messages_field="m"), load_tokenizer("bytes")
    )
    assert not mask.any()  # no assistant turn: nothing to learn, not even the EOD


def test_bad_records_and_options_name_what_is_wrong(tmp_path: Path) -> None:
    src = tmp_path / "sft.jsonl"
    src.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n[1]\n')

    def options(**kw: object) -> ConvertOptions:
        base = dict(tokenizer="bytes", prompt_field="prompt", response_field="response")
        return ConvertOptions(str(src), str(tmp_path / "out"), progress="none", **{**base, **kw})  # type: ignore[arg-type]

    with pytest.raises(ConvertError) as info:
        convert(options())
    # the fields the record has, and no --on-error skip, which would drop every record of a
    # file whose flag names the wrong field (#49)
    assert str(info.value) == (
        f"{src}:2: no field 'response' (--response-field); the record's fields: 'prompt'"
    )
    with pytest.raises(ConvertError) as info:
        convert(options(prompt_field="question", overwrite=True))
    assert str(info.value) == (
        f"{src}:1: no field 'question' (--prompt-field); the record's fields: 'prompt', 'response'"
    )
    result = convert(options(on_error="skip", overwrite=True))
    assert [w for w, _ in result.skipped] == [f"{src}:2", f"{src}:3"]
    assert result.indexes[""].num_targets == 2  # "b" and the EOD
    with pytest.raises(ConvertOptionError, match="go together"):
        convert(options(response_field=""))
    with pytest.raises(ConvertOptionError, match="not with --prompt-field"):
        convert(options(messages_field="messages"))
    text = tmp_path / "a.txt"
    text.write_text("hello")
    with pytest.raises(ConvertOptionError, match="read .jsonl records"):
        convert(
            ConvertOptions(
                str(text),
                str(tmp_path / "o2"),
                tokenizer="bytes",
                prompt_field="p",
                response_field="r",
            )
        )
    with pytest.raises(ConvertOptionError, match="re-packing token shards with a loss mask"):
        convert(ConvertOptions(str(tmp_path / "out"), str(tmp_path / "o3")))
