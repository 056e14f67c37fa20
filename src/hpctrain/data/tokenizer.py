"""Tokenizers for language-model data: the built-in bytes, a `tokenizer.json`, a sentencepiece
`tokenizer.model` or a tiktoken BPE file.

Torch-free, and importable without the optional libraries (only loading a file needs its own:
`pip install 'hpctrain[text]'` for `tokenizer.json`, `'hpctrain[sentencepiece]'`,
`'hpctrain[tiktoken]'`). Compute nodes are offline, so a hub name is never fetched: a spec that
is not `bytes` or an existing file is an error naming it. Which kind a file is goes by its name:

- `"bytes"` (built in, needs no file, so it always works offline): a text's UTF-8 bytes are
  its ids 0..255, the end-of-document (EOD) id is 256, the vocabulary 257 ids.
- `*.tiktoken` (or a `*.model` whose first line is `BASE64 RANK`, like Llama 3's): a tiktoken
  BPE file, one `base64-token rank` per line, every single byte among the tokens. It holds no
  special tokens, so hpctrain appends one, the EOD, at id max rank + 1 (`vocab_size` max rank
  + 2), named `<|endoftext|>` or `eod_token`; its text inside a document is ordinary text. The
  file holds no split pattern either: texts are split with `TIKTOKEN_PATTERN` (cl100k_base's,
  also Llama 3's) before the merges. (OpenAI's own encodings put their specials elsewhere, e.g.
  cl100k_base's `<|endoftext|>` at 100257: weights trained by them need their ids, hpctrain's
  do not.)
- any other `*.model`: a sentencepiece model. The EOD id is the control piece `eod_token`
  when given, else the model's EOS (`</s>` unless trained otherwise), else the first of
  `EOD_CANDIDATES` that is a control piece; control pieces are never matched in a text. No BOS
  is added. `vocab_size` is the number of pieces.
- any other file: a Hugging Face `tokenizer.json`. Texts are encoded without the tokenizer's
  post-processor specials (no BOS/CLS added), and the text of a special token inside a text is
  ordinary text (`encode_special_tokens`): documents are separated by the EOD id alone. The
  EOD id is the special token named by `eod_token` when given, else the first of
  `EOD_CANDIDATES` that is a special token of the tokenizer; an ordinary word, or a tokenizer
  with none of them, is an error. `vocab_size` is the largest id + 1 (ids need not be
  contiguous).

A token index (`hpctrain.data.index`) records the tokenizer's `info()`: name, vocab_size,
eod_id and the sha256 of the file ("" for the built-in). `check_tokenizer` compares a run's
`data.tokenizer` with it before any work, by that sha256 for every kind of file.
"""

from __future__ import annotations

import base64
import hashlib
import importlib
import os
import re
from typing import Any

import numpy as np

from hpctrain.errors import UsageError, install_hint

BYTES = "bytes"
BYTES_EOD = 256
# The end-of-document tokens of common tokenizers (GPT-2/NeoX/Qwen, Llama 3, Llama 2/Mistral/
# T5, Gemma), in the order they are looked for; --eod-token overrides.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|eot_id|>")
# The kinds of tokenizer (`Tokenizer.kind`).
JSON, SENTENCEPIECE, TIKTOKEN = "tokenizer.json", "sentencepiece", "tiktoken"
TIKTOKEN_EOD = "<|endoftext|>"
# The text of a generated id past the tokenizer's vocabulary (`Tokenizer.decode`).
UNKNOWN = "\ufffd"
# The pre-tokenizer split of cl100k_base (and of Llama 3's tiktoken file): a tiktoken file does
# not say which pattern it was trained with, so one is fixed and documented.
TIKTOKEN_PATTERN = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
    r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)


class TokenizerError(UsageError, ValueError):
    """A tokenizer that cannot be loaded or used (names the spec or file)."""


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (how a token index identifies a tokenizer file)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """Text <-> token ids, with the end-of-document id documents are separated by.

    Build one with `load_tokenizer`. `encode` never appends the EOD id (the caller does, once
    per document); `decode` leaves special ids (the EOD among them) out. `kind` is `"bytes"`,
    `JSON`, `SENTENCEPIECE` or `TIKTOKEN`.
    """

    def __init__(
        self,
        name: str,
        vocab_size: int,
        eod_id: int,
        sha256: str = "",
        backend: Any = None,
        kind: str = BYTES,
        specials: dict[str, int] | None = None,
    ) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self.sha256 = sha256
        self.kind = kind
        self.specials = dict(specials or {})  # special token text -> id (encode_template)
        # encode(text) -> ids and decode(ids) -> text, specials left out; None for bytes
        self._backend = backend

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no EOD appended). UnicodeEncodeError: text that is not valid
        Unicode (lone surrogates, e.g. from undecodable bytes)."""
        return [int(i) for i in self.encode_array(text)]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int64 array (what convert uses: no Python int per id)."""
        if self._backend is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        text.encode("utf-8")  # the byte tokenizer's check: lone surrogates are not text
        return np.asarray(self._backend.encode(text), dtype=np.int64)

    def encode_template(self, text: str) -> np.ndarray:
        """The int64 ids of text a chat template wrote: the texts of the special tokens in it
        become their ids (in a document's own text they are ordinary text, see `encode`)."""
        if not self.specials:
            return self.encode_array(text)
        names = sorted(self.specials, key=len, reverse=True)  # the longest match first
        parts = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
        ids = [
            np.array([self.specials[part]], dtype=np.int64) if i % 2 else self.encode_array(part)
            for i, part in enumerate(parts)
            if part
        ]
        return np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)

    def decode(self, ids: list[int] | np.ndarray, *, unknown: str | None = None) -> str:
        """The text of `ids`, special ids (EOD) left out; bytes that are not UTF-8 become U+FFFD.

        Args:
            unknown: the text of an id outside [0, vocab_size), for ids a model generated: a
                model's vocabulary may be larger than its tokenizer's (embeddings padded to a
                round number, as Qwen2's 151,936 rows for 151,665 tokens), and an id past the
                tokenizer's has no text. None: such an id is an error.

        Raises:
            ValueError: an id outside [0, vocab_size) and `unknown` is None.
        """
        arr = np.asarray(ids, dtype=np.int64)
        outside = (arr < 0) | (arr >= self.vocab_size)
        if outside.any():
            if unknown is None:
                raise ValueError(f"token ids must lie in [0, {self.vocab_size}) for {self.name}")
            texts, start = [], 0
            for at in np.flatnonzero(outside).tolist():
                texts += [self.decode(arr[start:at]), unknown]
                start = at + 1
            return "".join(texts) + self.decode(arr[start:])
        if self._backend is None:
            return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return str(self._backend.decode([int(i) for i in arr]))

    def info(self) -> dict[str, Any]:
        """The index's `tokenizer` object: name (a file's absolute path, so that the index
        names it from any folder), vocab_size, eod_id, sha256."""
        return {
            "name": self.name if self.kind == BYTES else os.path.abspath(self.name),
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "sha256": self.sha256,
        }


def _library(module: str, extra: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError:
        raise TokenizerError(
            f"reading {what} needs the {module} library: {install_hint(extra)}"
        ) from None


def file_kind(path: str) -> str:
    """`TIKTOKEN`, `SENTENCEPIECE` or `JSON`, by the file's name (see the module doc)."""
    if path.endswith(".tiktoken"):
        return TIKTOKEN
    if not path.endswith(".model"):
        return JSON
    with open(path, "rb") as f:
        first = f.readline(4096).split()
    # A sentencepiece model is a protobuf; Llama 3 ships a tiktoken file as tokenizer.model.
    if len(first) == 2 and first[1].isdigit() and re.fullmatch(rb"[A-Za-z0-9+/=]+", first[0]):
        return TIKTOKEN
    return SENTENCEPIECE


def load_tokenizer(spec: str, eod_token: str = "") -> Tokenizer:
    """`"bytes"` or the path of a tokenizer file (see the module doc for the kinds and EOD rules).

    Raises:
        TokenizerError: an empty spec, a path that is not a file (hub names are not fetched),
            an unreadable file, no EOD token, or the file's library missing.
    """
    if spec == BYTES:
        if eod_token:
            raise TokenizerError(f"--eod-token {eod_token!r}: the bytes tokenizer's EOD is 256")
        return Tokenizer(BYTES, BYTES_EOD + 1, BYTES_EOD)
    if not spec:
        raise TokenizerError(
            "no tokenizer given: use 'bytes' or the path of a tokenizer.json, a sentencepiece "
            "tokenizer.model or a *.tiktoken file"
        )
    if not os.path.isfile(spec):
        raise TokenizerError(
            f"tokenizer {spec!r}: no such file; give 'bytes' or the path of a tokenizer.json, "
            "tokenizer.model or *.tiktoken (hub names are not downloaded: compute nodes are "
            "offline; save the tokenizer to a file on a machine that has the network)"
        )
    kind = file_kind(spec)
    if kind == TIKTOKEN:
        return _load_tiktoken(spec, eod_token)
    if kind == SENTENCEPIECE:
        return _load_sentencepiece(spec, eod_token)
    return _load_json(spec, eod_token)


class _HFBackend:
    def __init__(self, hf: Any) -> None:
        self.hf = hf

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: list[int]) -> str:
        return str(self.hf.decode(ids, skip_special_tokens=True))


def _load_json(spec: str, eod_token: str) -> Tokenizer:
    tokenizers = _library("tokenizers", "text", "a tokenizer.json")
    try:
        hf = tokenizers.Tokenizer.from_file(spec)
    except Exception as exc:  # the Rust side raises its own exception type
        raise TokenizerError(f"{spec}: not a readable tokenizer.json: {exc}") from None
    # Special tokens are matched in no document: a web page holding the text "<|endoftext|>"
    # is one document, encoded as ordinary text, not two split at an EOD id.
    hf.encode_special_tokens = True
    added = hf.get_added_tokens_decoder()
    specials = {token.content: int(i) for i, token in added.items() if token.special}
    if eod_token:
        if eod_token not in specials:
            what = "an ordinary token" if hf.token_to_id(eod_token) is not None else "not"
            raise TokenizerError(
                f"{spec}: --eod-token {eod_token!r} is {what} in its vocabulary, not a special "
                f"token (documents could hold it); its special tokens: "
                f"{', '.join(sorted(specials)) or 'none'}"
            )
        eod_id = specials[eod_token]
    else:
        eod_id = _first_candidate(spec, specials)
    # Ids need not be contiguous (a tokenizer.json may hold id 50 among 6 tokens): the ids
    # written must all lie below vocab_size, which also picks tokens.u16 or tokens.u32.
    ids = [*hf.get_vocab(with_added_tokens=True).values(), *added]
    vocab_size = max(int(hf.get_vocab_size(with_added_tokens=True)), max(ids, default=-1) + 1)
    return Tokenizer(
        spec, vocab_size, int(eod_id), file_sha256(spec), _HFBackend(hf), JSON, specials
    )


def _first_candidate(spec: str, specials: dict[str, int]) -> int:
    found = [specials[t] for t in EOD_CANDIDATES if t in specials]
    if not found:
        raise TokenizerError(
            f"{spec}: none of the end-of-document tokens {', '.join(EOD_CANDIDATES)} is a "
            "special token of it; name one with --eod-token TOKEN"
        )
    return found[0]


class _SentencePieceBackend:
    def __init__(self, sp: Any) -> None:
        self.sp = sp

    def encode(self, text: str) -> list[int]:
        return list(self.sp.encode(text, out_type=int))

    def decode(self, ids: list[int]) -> str:
        # control pieces (EOS, BOS, ...) decode to nothing
        return str(self.sp.decode(ids))


def _load_sentencepiece(spec: str, eod_token: str) -> Tokenizer:
    library = _library("sentencepiece", "sentencepiece", "a sentencepiece tokenizer.model")
    try:
        sp = library.SentencePieceProcessor(model_file=spec)
    except Exception as exc:  # RuntimeError or OSError from the C++ side
        raise TokenizerError(f"{spec}: not a readable sentencepiece model: {exc}") from None
    size = int(sp.get_piece_size())
    # Control pieces are never produced from a text, so a document cannot hold the EOD id.
    controls = {str(sp.id_to_piece(i)): i for i in range(size) if sp.is_control(i)}
    if eod_token:
        if eod_token not in controls:
            known = int(sp.piece_to_id(eod_token))
            what = "an ordinary piece" if sp.id_to_piece(known) == eod_token else "not"
            raise TokenizerError(
                f"{spec}: --eod-token {eod_token!r} is {what} in its vocabulary, not a control "
                f"piece (documents could hold it); its control pieces: "
                f"{', '.join(sorted(controls)) or 'none'}"
            )
        eod_id = controls[eod_token]
    elif int(sp.eos_id()) >= 0:
        eod_id = int(sp.eos_id())
    else:
        eod_id = _first_candidate(spec, controls)
    backend = _SentencePieceBackend(sp)
    return Tokenizer(spec, size, eod_id, file_sha256(spec), backend, SENTENCEPIECE, controls)


class _TiktokenBackend:
    def __init__(self, encoding: Any, eod_id: int) -> None:
        self.encoding = encoding
        self.eod_id = eod_id

    def encode(self, text: str) -> list[int]:
        # encode_ordinary: the EOD's text inside a document is ordinary text
        return list(self.encoding.encode_ordinary(text))

    def decode(self, ids: list[int]) -> str:
        return str(self.encoding.decode([i for i in ids if i != self.eod_id], errors="replace"))


def read_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """A tiktoken BPE file's `{token bytes: rank}` (the format of `load_tiktoken_bpe`, read
    here without its download cache, and with errors naming the file and line).

    Raises:
        TokenizerError: a line that is not `BASE64 RANK`, or a single byte missing.
    """
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError:  # binascii.Error is a ValueError too
                raise TokenizerError(
                    f"{path}:{number}: not a tiktoken BPE line 'BASE64 RANK'"
                ) from None
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(
            f"{path}: {len(missing)} of the 256 single bytes are no token (first: "
            f"{missing[0]}); a tiktoken file must hold every byte to encode any text"
        )
    return ranks


def _load_tiktoken(spec: str, eod_token: str) -> Tokenizer:
    library = _library("tiktoken", "tiktoken", "a tiktoken file")
    ranks = read_tiktoken_ranks(spec)
    eod_id = max(ranks.values()) + 1
    try:
        encoding = library.Encoding(
            os.path.basename(spec),
            pat_str=TIKTOKEN_PATTERN,
            mergeable_ranks=ranks,
            special_tokens={eod_token or TIKTOKEN_EOD: eod_id},
        )
    except Exception as exc:  # ValueError, or the Rust side's own
        raise TokenizerError(f"{spec}: not a usable tiktoken BPE file: {exc}") from None
    backend = _TiktokenBackend(encoding, eod_id)
    specials = {eod_token or TIKTOKEN_EOD: eod_id}
    return Tokenizer(spec, eod_id + 1, eod_id, file_sha256(spec), backend, TIKTOKEN, specials)


def _describe(info: dict[str, Any]) -> str:
    sha = str(info.get("sha256") or "")
    return f"{info.get('name')!r}" + (f" (sha256 {sha[:12]})" if sha else "")


def describe_tokenizer(info: dict[str, Any]) -> str:
    """`'NAME' (sha256 PREFIX, vocab_size V, eod_id E)`: a tokenizer record in one line."""
    sha = str(info.get("sha256") or "")
    return (
        f"{info.get('name')!r} ({'sha256 ' + sha[:12] + ', ' if sha else ''}vocab_size "
        f"{info.get('vocab_size')}, eod_id {info.get('eod_id')})"
    )


def same_tokenizer(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Whether two tokenizer records (an index's `tokenizer` object, a checkpoint's) give ids
    the same meaning: the same file by its sha256 (the built-in bytes: by name, without
    one), the same vocabulary size and end-of-document id. A file's path may differ (a moved
    or copied tokenizer is the same tokenizer)."""
    sha_a, sha_b = str(a.get("sha256") or ""), str(b.get("sha256") or "")
    same_file = sha_a == sha_b if (sha_a or sha_b) else a.get("name") == b.get("name")
    return (
        same_file
        and int(a.get("vocab_size") or 0) == int(b.get("vocab_size") or 0)
        and int(a.get("eod_id", -1)) == int(b.get("eod_id", -1))
    )


def recorded_info(info: dict[str, Any]) -> dict[str, Any]:
    """The tokenizer record a checkpoint keeps (`info`: an index's): the same, with a file's
    name made absolute when it is a relative path that exists from here (an index converted
    before names were stored absolute), so that export and generate find it from anywhere."""
    name = str(info.get("name") or "")
    if name and name != BYTES and not os.path.isabs(name) and os.path.isfile(name):
        return {**info, "name": os.path.abspath(name)}
    return dict(info)


def check_tokenizer(
    index: Any, spec: str, where: str, key: str = "data.tokenizer"
) -> dict[str, Any]:
    """Check that a run's `data.tokenizer` (`spec`) is the tokenizer `index` was converted with.

    `spec` "" takes the index's; "bytes" must match by name; a path by the sha256 of the file
    (the file is hashed, not loaded: this needs none of the tokenizer libraries). `index` is
    a `ShardIndex`, `where` its URL, `key` the setting errors name. Returns the index's
    tokenizer object (name, vocab_size, eod_id, sha256).

    Raises:
        ConfigError: the index is not a token index, the file is missing, or the tokenizers
            differ (naming both, with sha256 prefixes, and `where`).
    """
    from hpctrain.config import ConfigError

    info = getattr(index, "tokenizer", None)
    if not info:
        raise ConfigError(
            f"{where}: not a token index (no tokenizer); convert text with "
            "hpctrain convert SRC DEST --tokenizer bytes|PATH"
        )
    if not spec:
        return dict(info)
    if spec == BYTES:
        ours = {"name": BYTES, "sha256": ""}
        same = info.get("name") == BYTES and not info.get("sha256")
    else:
        if not os.path.isfile(spec):
            raise ConfigError(f"{key} = {spec!r}: no such file (and not 'bytes')")
        ours = {"name": spec, "sha256": file_sha256(spec)}
        same = ours["sha256"] == info.get("sha256")
    if not same:
        raise ConfigError(
            f"{key} = {_describe(ours)} differs from the tokenizer {where} was "
            f"converted with, {_describe(info)}; give that one (or '' to take the index's)"
        )
    return dict(info)


def check_recorded_tokenizer(
    recorded: dict[str, Any], info: dict[str, Any], model: str, data: str, *, config: bool = False
) -> None:
    """Refuse data whose tokenizer (`info`, its index's) is not the one a checkpoint records
    (`recorded`): the same ids would mean other tokens, and training or scoring goes on
    without an error. `model` names the checkpoint (or `model.init_from=RUN`), `data` the
    data (`data.train=PATH`).

    Raises:
        DataError: (exit 3) the data changed under a checkpoint (a resume, eval, predict);
            `ConfigError` (exit 2) with `config`: the run's settings put them together (a
            warm start). One line naming both tokenizers.
    """
    from hpctrain.config import ConfigError
    from hpctrain.errors import DataError

    if same_tokenizer(recorded, info):
        return
    error = ConfigError if config else DataError
    raise error(
        f"{data}: converted with the tokenizer {describe_tokenizer(info)}, but {model} was "
        f"trained on {describe_tokenizer(recorded)}: the same ids would stand for other tokens; "
        "convert the data with the model's tokenizer"
    )
