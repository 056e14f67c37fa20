"""Tokenizers for language-model data: the built-in byte tokenizer or a `tokenizer.json` file.

Torch-free, and importable without the optional `tokenizers` library (only loading a
`tokenizer.json` needs it: `pip install 'hpctrain[text]'`).

- `"bytes"` (built in, needs no file, so it always works offline): a text's UTF-8 bytes are
  its ids 0..255, the end-of-document (EOD) id is 256, the vocabulary 257 ids.
- A PATH to a Hugging Face `tokenizer.json`. Compute nodes are offline, so a hub name is never
  fetched: a spec that is not an existing file is an error naming it. Texts are encoded
  without the tokenizer's post-processor specials (no BOS/CLS added), and the text of a
  special token inside a text is ordinary text (`encode_special_tokens`): documents are
  separated by the EOD id alone. The EOD id is the special token named by `eod_token` when
  given, else the first of `EOD_CANDIDATES` that is a special token of the tokenizer; an
  ordinary word, or a tokenizer with none of them, is an error. `vocab_size` is the largest
  id + 1 (ids need not be contiguous).

A token index (`hpctrain.data.index`) records the tokenizer's `info()`: name, vocab_size,
eod_id and the sha256 of the file ("" for the built-in). `check_tokenizer` compares a run's
`data.tokenizer` with it before any work.
"""

from __future__ import annotations

import hashlib
import os
from typing import Any

import numpy as np

from hpctrain.errors import UsageError

BYTES = "bytes"
BYTES_EOD = 256
TEXT_EXTRA_HINT = (
    "reading a tokenizer.json needs the tokenizers library: pip install 'hpctrain[text]'"
)
# The end-of-document tokens of common tokenizers (GPT-2/NeoX/Qwen, Llama 3, Llama 2/Mistral/
# T5, Gemma), in the order they are looked for; --eod-token overrides.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eos|>", "<|eot_id|>")


class TokenizerError(UsageError, ValueError):
    """A tokenizer that cannot be loaded or used (names the spec or file)."""


def file_sha256(path: str) -> str:
    """The sha256 of a file's bytes (how a token index identifies a tokenizer.json)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class Tokenizer:
    """Text <-> token ids, with the end-of-document id documents are separated by.

    Build one with `load_tokenizer`. `encode` never appends the EOD id (the caller does, once
    per document); `decode` leaves special ids (the EOD among them) out.
    """

    def __init__(
        self, name: str, vocab_size: int, eod_id: int, sha256: str = "", hf: Any = None
    ) -> None:
        self.name = name
        self.vocab_size = vocab_size
        self.eod_id = eod_id
        self.sha256 = sha256
        self._hf = hf  # tokenizers.Tokenizer, or None for the byte tokenizer

    def encode(self, text: str) -> list[int]:
        """The ids of `text` (no EOD appended). UnicodeEncodeError: text that is not valid
        Unicode (lone surrogates, e.g. from undecodable bytes)."""
        return [int(i) for i in self.encode_array(text)]

    def encode_array(self, text: str) -> np.ndarray:
        """`encode` as an int64 array (what convert uses: no Python int per id)."""
        if self._hf is None:
            return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int64)
        text.encode("utf-8")  # the byte tokenizer's check: lone surrogates are not text
        return np.asarray(self._hf.encode(text, add_special_tokens=False).ids, dtype=np.int64)

    def decode(self, ids: list[int] | np.ndarray) -> str:
        """The text of `ids`, special ids (EOD) left out; bytes that are not UTF-8 become U+FFFD.

        Raises:
            ValueError: an id outside [0, vocab_size).
        """
        arr = np.asarray(ids, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token ids must lie in [0, {self.vocab_size}) for {self.name}")
        if self._hf is None:
            return arr[arr < 256].astype(np.uint8).tobytes().decode("utf-8", errors="replace")
        return str(self._hf.decode([int(i) for i in arr], skip_special_tokens=True))

    def info(self) -> dict[str, Any]:
        """The index's `tokenizer` object: name, vocab_size, eod_id, sha256."""
        return {
            "name": self.name,
            "vocab_size": self.vocab_size,
            "eod_id": self.eod_id,
            "sha256": self.sha256,
        }


def _hf_module() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise TokenizerError(TEXT_EXTRA_HINT) from None
    return tokenizers


def load_tokenizer(spec: str, eod_token: str = "") -> Tokenizer:
    """`"bytes"` or the path of a `tokenizer.json` (see the module doc for the EOD rule).

    Raises:
        TokenizerError: an empty spec, a path that is not a file (hub names are not fetched),
            an unreadable file, no EOD token, or the `tokenizers` library missing.
    """
    if spec == BYTES:
        if eod_token:
            raise TokenizerError(f"--eod-token {eod_token!r}: the bytes tokenizer's EOD is 256")
        return Tokenizer(BYTES, BYTES_EOD + 1, BYTES_EOD)
    if not spec:
        raise TokenizerError("no tokenizer given: use 'bytes' or the path of a tokenizer.json")
    if not os.path.isfile(spec):
        raise TokenizerError(
            f"tokenizer {spec!r}: no such file; give 'bytes' or the path of a tokenizer.json "
            "(hub names are not downloaded: compute nodes are offline; save the tokenizer "
            "with tokenizer.save('tokenizer.json') on a machine that has the network)"
        )
    tokenizers = _hf_module()
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
        found = [specials[t] for t in EOD_CANDIDATES if t in specials]
        if not found:
            raise TokenizerError(
                f"{spec}: none of the end-of-document tokens {', '.join(EOD_CANDIDATES)} is a "
                "special token of it; name one with --eod-token TOKEN"
            )
        eod_id = found[0]
    # Ids need not be contiguous (a tokenizer.json may hold id 50 among 6 tokens): the ids
    # written must all lie below vocab_size, which also picks tokens.u16 or tokens.u32.
    ids = [*hf.get_vocab(with_added_tokens=True).values(), *added]
    vocab_size = max(int(hf.get_vocab_size(with_added_tokens=True)), max(ids, default=-1) + 1)
    return Tokenizer(spec, vocab_size, int(eod_id), file_sha256(spec), hf)


def _describe(info: dict[str, Any]) -> str:
    sha = str(info.get("sha256") or "")
    return f"{info.get('name')!r}" + (f" (sha256 {sha[:12]})" if sha else "")


def check_tokenizer(
    index: Any, spec: str, where: str, key: str = "data.tokenizer"
) -> dict[str, Any]:
    """Check that a run's `data.tokenizer` (`spec`) is the tokenizer `index` was converted with.

    `spec` "" takes the index's; "bytes" must match by name; a path by the sha256 of the file
    (the file is hashed, not loaded: this needs no `tokenizers`). `index` is a `ShardIndex`,
    `where` its URL, `key` the setting errors name. Returns the index's tokenizer object (name, vocab_size, eod_id, sha256).

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
