"""Instruction data: JSONL records -> one document of token ids with a loss mask each.

`hpctrain convert FILE.jsonl DEST --tokenizer T` with

- `--prompt-field prompt --response-field response`: a record becomes the document
  `prompt + response + EOD`, the prompt's and the response's ids encoded apart and joined
  (no separator is added: end the prompt with one, e.g. a newline, if the model should see
  one). The response's tokens and the EOD are targets, the prompt's are not.
- `--messages-field messages`: a record's field holds a chat, `[{"role": ..., "content":
  ...}, ...]`. It is rendered with the `chat_template` of the tokenizer folder (the
  `chat_template.jinja` or `tokenizer_config.json` beside the tokenizer file), in a sandboxed
  jinja2 environment as transformers renders it (`messages`, `add_generation_prompt`, the
  config's `bos_token`/`eos_token`/..., `raise_exception`, `strftime_now`), else with the
  plain template below. Only assistant turns are targets: an assistant message's content and
  the template's text after it up to the end of its turn (the end-of-turn token: the model
  learns to stop); the template's headers (`<|im_start|>assistant\\n`), system and user turns
  are not. The EOD is a target when the last message is the assistant's.

  The turns are found by rendering the template once per prefix of the chat (`messages[:i]`),
  with each content replaced by a placeholder: a template must render a chat as the
  rendering of its first turns followed by the next turn's text (every common template does)
  and write each content once, as given. The template's own text is encoded with the
  tokenizer's special tokens recognised (`<|im_start|>` becomes its id), a content as
  ordinary text (a user cannot inject a special token). A template that writes the EOD token
  inside a chat (Llama 2's `</s>` after every assistant turn with the `</s>` EOD) is an error
  naming the record: choose another `--eod-token`; one at the very end is the document's EOD.

  The plain template (no chat_template in the tokenizer folder, or `--tokenizer bytes`)::

      <|ROLE|>\\n CONTENT \\n     for each message, e.g. "<|user|>\\nHi\\n<|assistant|>\\nHello\\n"

  with `<|ROLE|>\\n` a header and, for the assistant, `CONTENT\\n` the target.

The mask travels beside the ids (`encode_record`): `hpctrain.convert.text` stores it in every
sample as a `loss_mask.bits` member (`hpctrain.data.tokens`) before the token member, and the
index counts the targets of each shard (`num_targets`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

from hpctrain.data.tokenizer import Tokenizer

ASSISTANT = "assistant"
PLAIN_TEMPLATE = "plain"
# Placeholders for the contents while a template renders: private-use characters no real
# text holds.
_OPEN, _CLOSE = "\ue000", "\ue001"


class RecordError(ValueError):
    """A record that cannot become a document (the reason; the caller names the record)."""


@dataclass(frozen=True)
class RecordFormat:
    """How records become documents (picklable: tokenize workers get one)."""

    prompt_field: str = ""
    response_field: str = ""
    messages_field: str = ""
    template: str = ""  # a chat template's jinja source; "" for the plain template
    template_file: str = ""  # where it came from (errors, the index's settings)
    variables: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...

    def settings(self) -> dict[str, Any]:
        """What the index records (and a resumed conversion must match)."""
        out: dict[str, Any] = {
            "prompt_field": self.prompt_field,
            "response_field": self.response_field,
            "messages_field": self.messages_field,
        }
        if self.messages_field:
            digest = hashlib.sha256(self.template.encode()).hexdigest()
            out["chat_template"] = self.template_file or PLAIN_TEMPLATE
            out["chat_template_sha256"] = digest if self.template else ""
        return out


def record_format(
    prompt_field: str, response_field: str, messages_field: str, tokenizer_spec: str
) -> RecordFormat | None:
    """The format the convert options ask for, None for plain text (`--text-field`).

    Raises:
        ValueError: a prompt field without a response field or the reverse, both kinds at
            once, or an unreadable `tokenizer_config.json` (the message names it).
    """
    if not (prompt_field or response_field or messages_field):
        return None
    if messages_field and (prompt_field or response_field):
        raise ValueError("--messages-field: not with --prompt-field/--response-field")
    if bool(prompt_field) != bool(response_field) and not messages_field:
        raise ValueError("--prompt-field and --response-field go together")
    if not messages_field:
        return RecordFormat(prompt_field=prompt_field, response_field=response_field)
    template, source, variables = chat_template(tokenizer_spec)
    return RecordFormat(
        messages_field=messages_field,
        template=template,
        template_file=source,
        variables=variables,
    )


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...} in older configs
        value = value.get("content")
    return value if isinstance(value, str) else ""


def chat_template(tokenizer_spec: str) -> tuple[str, str, dict[str, str]]:
    """(template source, its file, template variables) of the tokenizer's folder; ("", "", {})
    when it has none (the plain template).

    Raises:
        ValueError: a `tokenizer_config.json` that is not JSON (naming it).
    """
    if not os.path.isfile(tokenizer_spec):  # "bytes"
        return "", "", {}
    folder = os.path.dirname(os.path.abspath(tokenizer_spec))
    config_path = os.path.join(folder, "tokenizer_config.json")
    config: dict[str, Any] = {}
    if os.path.isfile(config_path):
        try:
            with open(config_path, encoding="utf-8") as f:
                config = json.load(f)
        except (ValueError, OSError) as exc:
            raise ValueError(f"{config_path}: not readable JSON: {exc}") from None
    variables = {
        name: _token_text(config.get(name))
        for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        if _token_text(config.get(name))
    }
    jinja_path = os.path.join(folder, "chat_template.jinja")  # newer transformers save it so
    if os.path.isfile(jinja_path):
        with open(jinja_path, encoding="utf-8") as f:
            return f.read(), jinja_path, variables
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one, else the first
        named = {str(t.get("name")): str(t.get("template")) for t in template}
        template = named.get("default") or next(iter(named.values()), "")
    if isinstance(template, str) and template:
        return template, config_path, variables
    return "", "", {}


def jsonl_document(
    line: bytes, fmt: RecordFormat, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """`encode_record` of one JSONL line.

    Raises:
        RecordError: not UTF-8 or JSON, or see `encode_record`.
    """
    try:
        row = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise RecordError("not valid UTF-8") from None
    except ValueError as exc:
        raise RecordError(f"not valid JSON: {exc}") from None
    try:
        return encode_record(row, fmt, tokenizer)
    except UnicodeEncodeError:  # lone surrogates from JSON escapes
        raise RecordError("not valid UTF-8") from None


def encode_record(
    row: Any, fmt: RecordFormat, tokenizer: Tokenizer
) -> tuple[np.ndarray, np.ndarray]:
    """The document of one record: (int64 ids, EOD last; bool mask of the targets), same size.

    Raises:
        RecordError: a missing or mistyped field, or a template that cannot render it.
    """
    if not isinstance(row, dict):
        raise RecordError(f"a record is a JSON object, not {type(row).__name__}")
    if fmt.messages_field:
        segments, last_is_target = _chat_segments(_messages(row, fmt.messages_field), fmt)
    else:
        prompt = _text_field(row, fmt.prompt_field, "--prompt-field")
        response = _text_field(row, fmt.response_field, "--response-field")
        segments, last_is_target = [(prompt, False, False), (response, True, False)], True
    ids: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    for text, target, from_template in segments:
        part = tokenizer.encode_template(text) if from_template else tokenizer.encode_array(text)
        ids.append(part)
        mask.append(np.full(part.size, target, dtype=bool))
    joined = np.concatenate(ids) if ids else np.zeros(0, dtype=np.int64)
    targets = np.concatenate(mask) if mask else np.zeros(0, dtype=bool)
    eod = tokenizer.eod_id
    if joined.size and joined[-1] == eod and segments and segments[-1][2]:
        joined, targets = joined[:-1], targets[:-1]  # the template's closing EOS is the EOD
    if np.any(joined == eod):
        raise RecordError(
            f"encodes to the end-of-document id {eod} inside it (a chat template writing the "
            "EOD token between turns? choose another --eod-token)"
        )
    return np.append(joined, eod), np.append(targets, last_is_target)


# A field a flag names that a record lacks: the flag's mistake more likely than the record's
# (`tokenize.assemble` then suggests no `--on-error skip`, which would drop every record).
NO_FIELD = "no field "


def no_field(name: str, flag: str, row: dict[str, Any]) -> RecordError:
    fields = ", ".join(map(repr, row)) or "none"
    return RecordError(f"{NO_FIELD}{name!r} ({flag}); the record's fields: {fields}")


def _text_field(row: dict[str, Any], name: str, flag: str) -> str:
    if name not in row:
        raise no_field(name, flag, row)
    value = row[name]
    if not isinstance(value, str):
        raise RecordError(f"field {name!r} is {type(value).__name__}, not text")
    return value


def _messages(row: dict[str, Any], name: str) -> list[dict[str, str]]:
    if name not in row:
        raise no_field(name, "--messages-field", row)
    value = row[name]
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {name!r} is not a list of messages")
    messages = []
    for i, message in enumerate(value):
        if (
            not isinstance(message, dict)
            or not isinstance(message.get("role"), str)
            or not isinstance(message.get("content"), str)
        ):
            raise RecordError(f"{name}[{i}] is not a message {{'role': str, 'content': str}}")
        messages.append({**message, "role": message["role"], "content": message["content"]})
    return messages


def _chat_segments(
    messages: list[dict[str, str]], fmt: RecordFormat
) -> tuple[list[tuple[str, bool, bool]], bool]:
    """(text, is target, written by the template) pieces of a chat, and whether the EOD is."""
    last_is_target = messages[-1]["role"] == ASSISTANT
    if not fmt.template:
        segments = []
        for message in messages:
            is_assistant = message["role"] == ASSISTANT
            segments.append((f"<|{message['role']}|>\n", False, False))
            segments.append((message["content"] + "\n", is_assistant, False))
        return segments, last_is_target
    placeholders = [{**m, "content": f"{_OPEN}{i}{_CLOSE}"} for i, m in enumerate(messages)]
    render = _renderer(fmt)
    full = render(placeholders)
    where = fmt.template_file
    turn_ends = []
    for i in range(1, len(messages) + 1):
        prefix = render(placeholders[:i])
        if not full.startswith(prefix):
            raise RecordError(
                f"the chat template of {where} does not render a chat as its first turns "
                f"followed by the next (messages[:{i}] is no prefix of the whole)"
            )
        turn_ends.append(len(prefix))
    spans: list[tuple[int, int]] = []  # (start, end) of each content in `full`
    for i in range(len(messages)):
        token = f"{_OPEN}{i}{_CLOSE}"
        start = full.find(token)
        if start < 0 or full.count(token) != 1 or (spans and start < spans[-1][1]):
            raise RecordError(
                f"the chat template of {where} does not write each message's content once, in order"
            )
        spans.append((start, start + len(token)))
    # Cut `full` at every content's start and end and every turn's end; a template piece is a
    # target between an assistant content's end and its turn's end.
    cuts = sorted({0, len(full), *turn_ends, *(p for span in spans for p in span)})
    segments = []
    for lo, hi in itertools.pairwise(cuts):
        piece = full[lo:hi]
        content = next((i for i, span in enumerate(spans) if span[0] == lo), None)
        if content is not None:
            segments.append(
                (messages[content]["content"], messages[content]["role"] == ASSISTANT, False)
            )
            continue
        owner = next((i for i, end in enumerate(turn_ends) if lo < end), len(messages) - 1)
        after_content = lo >= spans[owner][1]
        target = messages[owner]["role"] == ASSISTANT and after_content
        segments.append((piece, target, True))
    return segments, last_is_target


def _renderer(fmt: RecordFormat) -> Any:
    """`render(messages) -> str` of the template, compiled once per format and process."""
    key = (fmt.template, tuple(sorted(fmt.variables.items())))
    if key not in _COMPILED:
        _COMPILED[key] = _compile(fmt)
    return _COMPILED[key]


_COMPILED: dict[Any, Any] = {}


def _compile(fmt: RecordFormat) -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.sandbox

    def raise_exception(message: str) -> None:
        raise RecordError(f"the chat template of {fmt.template_file} refuses it: {message}")

    def strftime_now(pattern: str) -> str:
        return datetime.now().strftime(pattern)

    # As transformers renders chat templates: sandboxed (a template is data from a download),
    # trim_blocks/lstrip_blocks, loop controls, a tojson that keeps non-ASCII text.
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = lambda value, indent=None: json.dumps(
        value, ensure_ascii=False, indent=indent
    )
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
    try:
        template = env.from_string(fmt.template)
    except jinja2.TemplateError as exc:
        raise RecordError(f"the chat template of {fmt.template_file}: {exc}") from None

    def render(messages: list[dict[str, str]]) -> str:
        try:
            return str(
                template.render(messages=messages, add_generation_prompt=False, **fmt.variables)
            )
        except RecordError:
            raise
        except Exception as exc:  # a template's own error: undefined names, bad types, ...
            raise RecordError(f"the chat template of {fmt.template_file}: {exc}") from None

    return render
