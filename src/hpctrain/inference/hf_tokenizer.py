"""The tokenizer of a `--format hf` export: its files, and what transformers makes of them.

The export carries the run's `tokenizer.json` and the files transformers reads beside it from
the folder it came from (`TOKENIZER_FILES`: the chat template, special tokens), with a
`tokenizer_config.json` whose `model_max_length` is the model's context (`write_tokenizer`).

transformers does not always load a folder's tokenizer as the file says: transformers 5 loads
its own class for some model types whatever the folder's `tokenizer_class` (`Qwen2Tokenizer`
for any `qwen2` folder: it rebuilds Qwen's pre-tokenizer from the vocabulary, so a tokenizer
that is not Qwen's loses its spaces and newlines, and `lm_eval --model hf` on the export then
scores another model). So the export loads the folder it wrote with `AutoTokenizer` and
compares its encodings of a few texts (`PROBES`: spaces, newlines, tabs, punctuation,
digits, accents) with the run's (`check_auto_tokenizer`). When they differ, it writes the
tokenizer files alone in `OUT/tokenizer/` (no `config.json`: AutoTokenizer then takes
`tokenizer.json` as it is) and checks that folder the same way; one warning says what differs
and the fix: `AutoTokenizer.from_pretrained("OUT/tokenizer")`, and for lm-evaluation-harness
`--model_args pretrained=OUT,tokenizer=OUT/tokenizer`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from hpctrain.data.tokenizer import Tokenizer

log = logging.getLogger(__name__)

# The files of a tokenizer that transformers' AutoTokenizer reads besides tokenizer.json
# (`transformers.tokenization_utils_base`, `transformers.utils.hub`): carried from the folder
# the run's tokenizer came from, so that the export's chat template and special tokens are
# the source's (`apply_chat_template` works on it).
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
)
CHAT_TEMPLATES_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
TOKENIZER_ONLY = "tokenizer"  # OUT/tokenizer: the tokenizer files alone (see the module)
PROBES = (
    "The cat sat on the mat.\nA second line,  two spaces\tand a tab.",
    "3,000 cafés naïvely cost $12.50 (about 11 EUR) - ok?\n\n  indented: x = [1, 2]",
)


def write_tokenizer(
    writer: Any, tokenizer: Tokenizer, init_from: str, eos: int, context: int
) -> None:
    """The run's tokenizer.json and the files of its folder into the export (`writer`: the
    export's `FolderWriter`)."""
    from hpctrain.models import hf

    writer.copy(Path(tokenizer.name), "tokenizer.json")
    companions = tokenizer_folder(Path(tokenizer.name), tokenizer.sha256, init_from)
    for file in TOKENIZER_FILES:
        if companions is not None and (companions / file).is_file():
            writer.copy(companions / file, file)
    if companions is not None and (companions / CHAT_TEMPLATES_DIR).is_dir():
        for template in sorted((companions / CHAT_TEMPLATES_DIR).glob("*.jinja")):
            writer.copy(template, f"{CHAT_TEMPLATES_DIR}/{template.name}")
    writer.write_json(
        TOKENIZER_CONFIG,
        tokenizer_config(
            writer.read_json(TOKENIZER_CONFIG),
            hf.special_token(Path(tokenizer.name), eos),
            context,
        ),
    )


def tokenizer_folder(tokenizer_json: Path, sha256: str, init_from: str) -> Path | None:
    """The folder whose `TOKENIZER_FILES` go with the run's tokenizer: the tokenizer.json's
    own folder when it has any of them, else the `model.init_from` folder when its
    tokenizer.json is the same file (by sha256); None when neither."""
    from hpctrain.data.tokenizer import file_sha256

    own = tokenizer_json.parent
    if any((own / f).is_file() for f in TOKENIZER_FILES):
        return own
    source = Path(init_from) / "tokenizer.json" if init_from else None
    if source is not None and source.is_file() and file_sha256(str(source)) == sha256:
        return source.parent
    return None


def tokenizer_config(source: dict[str, Any], eos_token: str, context: int) -> dict[str, Any]:
    """The export's `tokenizer_config.json`: the source folder's (its chat template, special
    tokens, class), with `model_max_length` the model's context (not the training
    `data.seq_len`, which would make transformers warn of indexing errors on longer texts)
    and the end-of-document token as EOS where the source names none."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **source}
    config.setdefault("eos_token", eos_token)
    config["model_max_length"] = context
    return config


def auto_encodings(folder: Path) -> tuple[str, list[list[int]] | str]:
    """(the class AutoTokenizer loads for `folder`, its ids of each probe without special
    tokens), or (class or "", why it could not encode)."""
    import transformers

    try:
        loaded = transformers.AutoTokenizer.from_pretrained(str(folder))
    except Exception as exc:  # whatever transformers raises: reported, not fatal
        return "", f"AutoTokenizer cannot load it ({type(exc).__name__}: {exc})"
    name = type(loaded).__name__
    try:
        return name, [list(loaded(text, add_special_tokens=False)["input_ids"]) for text in PROBES]
    except Exception as exc:  # as above
        return name, f"{name} cannot encode text ({type(exc).__name__}: {exc})"


def check_auto_tokenizer(writer: Any, tokenizer: Tokenizer, out: Path) -> str | None:
    """None when transformers' AutoTokenizer encodes the `PROBES` in the folder `writer` is
    writing as the run's tokenizer does; else the warning (see the module), after writing
    `OUT/tokenizer/` when that folder loads right. Without transformers: None (not checked)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        log.info("--format hf: transformers is not installed: the tokenizer was not checked")
        return None
    expected = [tokenizer.encode(text) for text in PROBES]
    name, got = auto_encodings(writer.tmp)
    if got == expected:
        return None
    what = got if isinstance(got, str) else differing(got, expected, tokenizer, name)
    alone = writer.tmp / TOKENIZER_ONLY
    alone.mkdir()
    for file in sorted(writer.tmp.iterdir()):
        if file.is_file() and (file.name == "tokenizer.json" or file.name in TOKENIZER_FILES):
            writer.copy(file, f"{TOKENIZER_ONLY}/{file.name}")
    if auto_encodings(alone)[1] == expected:
        fix = (
            f"{out / TOKENIZER_ONLY} holds the tokenizer files alone, which AutoTokenizer loads "
            f"as they are: AutoTokenizer.from_pretrained('{out / TOKENIZER_ONLY}'), and for "
            f"lm-evaluation-harness lm_eval --model hf --model_args "
            f"pretrained={out},tokenizer={out / TOKENIZER_ONLY}"
        )
    else:
        for file in alone.iterdir():
            file.unlink()
        alone.rmdir()
        fix = (
            f"load it with transformers.PreTrainedTokenizerFast(tokenizer_file="
            f"'{out / 'tokenizer.json'}') and hand that object to the harness"
        )
    return (
        f"--format hf: transformers' AutoTokenizer does not load {out}'s tokenizer as the run "
        f"encodes text: {what}; {fix}"
    )


def differing(
    got: list[list[int]], expected: list[list[int]], tokenizer: Tokenizer, name: str
) -> str:
    """`{name} encodes '...' as '...'`: the first probe it reads otherwise, decoded."""
    for text, theirs, ours in zip(PROBES, got, expected, strict=True):
        if theirs != ours:
            back = tokenizer.decode(theirs, unknown="\ufffd")
            return f"{name} encodes {text[:40]!r} as {back[:40]!r} ({len(theirs)} ids, not {len(ours)})"
    return f"{name} encodes otherwise"
