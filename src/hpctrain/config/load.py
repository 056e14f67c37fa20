"""YAML + `a.b=c` overrides → a validated, frozen `Config`.

Every mistake is reported as one line that names the dotted key, where the value came from
(the file or the command line) and what is allowed.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import logging
import math
import re
import types
import typing
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

import yaml

from hpctrain.config.rules import broken_rule
from hpctrain.config.schema import CausalLMConfig, Config
from hpctrain.config.yaml_text import (
    Plain,
    TextKeepingLoader,
    YamlRefused,
    parse_yaml,
    plain_values,
)
from hpctrain.config.yaml_text import load_yaml as load_yaml  # its home before yaml_text.py
from hpctrain.errors import EXIT_CONFIG, HpctrainError

T = TypeVar("T")
log = logging.getLogger("hpctrain")

# Keys that moved, old dotted key -> new: the old name still loads, with a one-line warning
# (none for a value at its default: every resolved config of an older hpctrain holds them).
MOVED_KEYS = {f"model.{f.name}": f"causal_lm.{f.name}" for f in dataclasses.fields(CausalLMConfig)}

# Every integer key: what a signed 64-bit C integer holds (torch, numpy and SLURM take no more).
INT_RANGE = (-(2**63), 2**63 - 1)


class ConfigError(HpctrainError, ValueError):
    """A bad config key or value; the message is one line naming the key and its source."""

    exit_code = EXIT_CONFIG
    label = "config error"


def _yaml_key(f: dataclasses.Field[Any]) -> str:
    return str(f.metadata.get("key", f.name))


def _fields_by_key(cls: type) -> dict[str, dataclasses.Field[Any]]:
    return {_yaml_key(f): f for f in dataclasses.fields(cls)}


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is typing.Literal:  # its words: 'auto'
        return " | ".join(map(repr, typing.get_args(tp)))
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and any(
        typing.get_origin(a) is typing.Literal for a in args
    ):
        return " | ".join(_describe(a) for a in args)  # float | 'auto'
    return getattr(tp, "__name__", str(tp).replace("typing.", ""))


def _coerce(
    value: Any, tp: Any, key: str, source: str, sources: Mapping[str, str] | None = None
) -> Any:
    """Check `value` against the annotation `tp`; ints are accepted where floats are expected.

    `sources` (dotted key -> where it came from) names the source of a list item's keys.
    """
    origin = typing.get_origin(tp)
    if isinstance(value, Plain) and origin is None:
        if tp is str:
            return value.text  # YAML 1.1 would make `off` False and `2024-01-01` a date
        value = value.value
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        if isinstance(value, Sequence) and not isinstance(value, str):
            # a list: the list member's own error names the item and key that is wrong
            lists = [a for a in args if typing.get_origin(a) is list]
            if lists:
                return _coerce(value, lists[0], key, source, sources)
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, key, source, sources)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} ({source}): expected {_describe(tp)}")
    if origin is typing.Literal:  # a word a number field also takes (`auto`)
        word = value.text if isinstance(value, Plain) else value
        if isinstance(word, str) and word in typing.get_args(tp):
            return word
        raise ConfigError(f"{key}={value!r} ({source}): expected {_describe(tp)}")
    if origin is list:
        (item_tp,) = typing.get_args(tp) or (Any,)
        if isinstance(value, str) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}={value!r} ({source}): expected a list")
        if dataclasses.is_dataclass(item_tp):
            sources = sources or {}
            items = []
            for i, v in enumerate(value):
                item_source = sources.get(f"{key}[{i}]", source)
                if not isinstance(v, Mapping):
                    raise ConfigError(f"{key}[{i}]={v!r} ({item_source}): expected a mapping")
                items.append(_build(item_tp, v, sources, f"{key}[{i}].", item_source))  # type: ignore[arg-type]
            return items
        return [_coerce(v, item_tp, f"{key}[{i}]", source) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}={value!r} ({source}): expected a mapping")
        return plain_values(dict(value))
    if tp is Any:
        return plain_values(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{key}={value!r} ({source}): expected true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT_RANGE[0] <= value <= INT_RANGE[1]:
                # numbers reach C APIs (torch, numpy, SLURM) that take at most 64 bits
                raise ConfigError(f"{key}={value!r} ({source}): out of range for a 64-bit integer")
            return value
        raise ConfigError(f"{key}={value!r} ({source}): expected an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:  # an integer literal beyond any float
                number = math.inf
            if not math.isfinite(number):
                # NaN passes every `min` check (nan < 0 is False) and inf never ends a wait
                raise ConfigError(f"{key}={value!r} ({source}): expected a finite number")
            return number
        if isinstance(value, str) and _is_non_finite_word(value):
            # `nan`, `inf` (YAML 1.2 spells them .nan, .inf): the same message as for those
            raise ConfigError(f"{key}={value!r} ({source}): expected a finite number")
        raise ConfigError(f"{key}={value!r} ({source}): expected a number")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return str(value)
        raise ConfigError(f"{key}={value!r} ({source}): expected a string")
    raise AssertionError(f"unsupported config annotation {tp!r} for {key}")


def _is_non_finite_word(text: str) -> bool:
    """`nan`, `inf`, `-Infinity`...: text Python reads as a float that is not finite."""
    try:
        return not math.isfinite(float(text))
    except ValueError:
        return False


def closest(word: Any, choices: Iterable[Any]) -> str | None:
    """The one of `choices` `word` is likely a misspelling of (None when none is close)."""
    names = [str(c) for c in choices]
    lower = {n.lower(): n for n in names}
    if str(word).lower() in lower:  # only the case differs
        return lower[str(word).lower()]
    close = difflib.get_close_matches(str(word), names, n=1, cutoff=0.6)
    return close[0] if close else None


def did_you_mean(word: Any, choices: Iterable[Any]) -> str:
    """`; did you mean 'fsdp'?` for a word close to one of `choices` ("" when none is)."""
    near = closest(word, choices)
    return f"; did you mean {near!r}?" if near is not None else ""


def _alias(value: Any, f: dataclasses.Field[Any]) -> Any:
    """Another spelling a field accepts for one of its choices (`fsdp2` for `fsdp`)."""
    aliases = f.metadata.get("aliases")
    if aliases and isinstance(value, str):
        return aliases.get(value.lower(), value)
    return value


def _check(value: Any, f: dataclasses.Field[Any], key: str, source: str) -> None:
    choices = f.metadata.get("choices")
    if choices is not None and isinstance(value, list):  # a list of choices: each one
        for item in value:
            if item not in choices:
                raise ConfigError(
                    f"{key}: {item!r} ({source}): must be one of "
                    f"{'|'.join(map(str, choices))}{did_you_mean(item, choices)}"
                )
    elif choices is not None and value not in choices:
        raise ConfigError(
            f"{key}={value!r} ({source}): must be one of "
            f"{'|'.join(map(str, choices))}{did_you_mean(value, choices)}"
        )
    if isinstance(value, str) and choices is None:
        return  # the word of a number field (`auto`): the bounds are the numbers'
    low = f.metadata.get("min")
    if low is not None and value < low:
        raise ConfigError(f"{key}={value!r} ({source}): must be >= {low}")
    above = f.metadata.get("above")
    if above is not None and value <= above:
        raise ConfigError(f"{key}={value!r} ({source}): must be > {above:g}")
    high = f.metadata.get("max")
    if high is not None and value > high:
        reason = f.metadata.get("max_reason", "")
        raise ConfigError(
            f"{key}={value!r} ({source}): must be <= {high}" + (f" ({reason})" if reason else "")
        )


def _build(
    cls: type[T],
    raw: Mapping[str, Any],
    sources: Mapping[str, str],
    prefix: str,
    parent_source: str | None = None,
) -> T:
    """`cls` from `raw`; `sources` name where each dotted key came from (else its parent's)."""
    fields = _fields_by_key(cls)
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        dotted = f"{prefix}{key}"
        source = sources.get(dotted, parent_source or sources.get("", "defaults"))
        if key not in fields:
            allowed = ", ".join(sorted(fields))
            near = closest(key, fields)  # named dotted, as overrides spell it
            hint = f": did you mean {prefix + near!r}? allowed" if near else "; allowed"
            raise ConfigError(f"unknown key {dotted!r} ({source}){hint} here: {allowed}")
        f = fields[key]
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            if not isinstance(value, Mapping):
                raise ConfigError(
                    f"{dotted}={value!r} ({source}): expected a mapping of {key}.* keys"
                )
            kwargs[f.name] = _build(tp, value, sources, f"{dotted}.", source)  # type: ignore[arg-type]
            continue
        coerced = _alias(_coerce(value, tp, dotted, source, sources), f)
        _check(coerced, f, dotted, source)
        kwargs[f.name] = coerced
    return cls(**kwargs)


# One part of an override's key: a name, then list indices (`train`, `train[0]`).
_KEY_PART = re.compile(r"([^.\[\]]+)((?:\[[0-9]+\])*)")


def _set_override(tree: dict[str, Any], sources: dict[str, str], text: str) -> None:
    """Apply the override `text` (`a.b=c`, `data.train[0].weight=3`) to `tree`.

    Every key the override sets, creates or replaces is recorded in `sources` as coming from
    the command line. A list item must exist already: an override can change a mixture
    source's weight, not add a source.
    """
    key, value = _parse_override(text)
    if key in MOVED_KEYS:
        key = _moved(key, value, "command line")
    parts = [_KEY_PART.fullmatch(part) for part in key.split(".")]
    node: Any = tree
    dotted = ""
    for n, match in enumerate(parts):
        assert match is not None  # _parse_override checked the key
        name, indices = match.group(1), [int(i) for i in re.findall(r"[0-9]+", match.group(2))]
        steps: list[str | int] = [name, *indices]
        for m, step in enumerate(steps):
            last = n == len(parts) - 1 and m == len(steps) - 1
            if isinstance(step, int):
                if not isinstance(node, list):
                    raise ConfigError(
                        f"override {text!r} (command line): {dotted} is not a list here"
                    )
                if step >= len(node):
                    raise ConfigError(
                        f"override {text!r} (command line): {dotted} has {len(node)} "
                        f"item{'s' if len(node) != 1 else ''}, so no item {step} (an override "
                        "changes an item, it does not add one)"
                    )
                dotted = f"{dotted}[{step}]"
            else:
                dotted = f"{dotted}.{step}" if dotted else step
            if last:
                node[step] = value
                sources[dotted] = "command line"
                return
            child = node[step] if isinstance(step, int) else node.get(step)
            if isinstance(child, list) and m == len(steps) - 1:
                rest = [p.group(0) for p in parts[n + 1 :] if p is not None]
                item = rest.pop(0) if rest[0].isdigit() else "0"
                example = ".".join([f"{dotted}[{item}]", *rest])
                raise ConfigError(
                    f"override {text!r} (command line): {dotted} is a list; name an item "
                    f"as in {example}={text.partition('=')[2]}"
                )
            if not isinstance(child, (dict, list)):
                child = {}
                node[step] = child
                sources[dotted] = "command line"  # created (or replaced) by the override
            node = child


def _moved(old: str, value: Any, source: str) -> str:
    """The new name of the moved key `old`, with the warning that names both."""
    new = MOVED_KEYS[old]
    name = new.split(".")[1]
    default = next(f.default for f in dataclasses.fields(CausalLMConfig) if f.name == name)
    if plain_values(value) != default:
        log.warning("%s (%s) is deprecated: it is now %s", old, source, new)
    return new


def _move_keys(tree: dict[str, Any], sources: dict[str, str]) -> None:
    """Move the `MOVED_KEYS` of a file's or a saved config's `tree` to their new place.

    Raises:
        ConfigError: both the old and the new key are set.
    """
    for old, new in MOVED_KEYS.items():
        old_section, name = old.split(".")
        section = tree.get(old_section)
        if not isinstance(section, dict) or name not in section:
            continue
        target = tree.setdefault(new.split(".")[0], {})
        if not isinstance(target, dict):
            continue  # `_build` names the section that is not a mapping
        source = sources.pop(old, sources.get(old_section, sources.get("", "defaults")))
        value = section.pop(name)
        if name in target:
            raise ConfigError(f"{old} and {new} are both set ({source}): keep {new} alone")
        target[name] = value
        sources[new] = source
        _moved(old, value, source)


def _collect_sources(
    tree: Mapping[str, Any], source: str, prefix: str, out: dict[str, str]
) -> None:
    for key, value in tree.items():
        dotted = f"{prefix}{key}"
        out[dotted] = source
        if isinstance(value, Mapping):
            _collect_sources(value, source, f"{dotted}.", out)


# A word of the command line that is an override: KEY=VALUE with a dotted key of names.
_OVERRIDE_WORD = re.compile(r"[A-Za-z_][\w-]*(?:\[[0-9]+\])*(?:\.[A-Za-z_][\w-]*(?:\[[0-9]+\])*)*=")


def is_override(word: str) -> bool:
    """Whether a command-line word is a `dotted.key=value` override (never a config path)."""
    return _OVERRIDE_WORD.match(word) is not None


def parse_override(text: str) -> tuple[str, Any]:
    """`a.b=c` → ("a.b", c), with c parsed as a YAML scalar (`7` → 7, `true` → True)."""
    key, value = _parse_override(text)
    return key, plain_values(value)


def _parse_override(text: str) -> tuple[str, Any]:
    """`parse_override` with booleans, numbers and dates kept with their text (`Plain`)."""
    key, sep, raw = text.partition("=")
    if not sep or not key or any(not _KEY_PART.fullmatch(part) for part in key.split(".")):
        raise ConfigError(
            f"override {text!r} (command line): expected key.sub=value (a list item: "
            "key[0].sub=value)"
        )
    try:
        value = parse_yaml(raw, TextKeepingLoader) if raw.strip() else ""
    except YamlRefused as exc:
        raise ConfigError(f"override {text!r} (command line): {exc}") from None
    except yaml.YAMLError:
        value = raw
    return key, value


# A config is a few KiB; reading more than this is a wrong path (a tar file, /dev/zero).
MAX_CONFIG_BYTES = 4 * 2**20


def read_config_text(path: Path) -> str:
    """The text of a config file: UTF-8 (a byte-order mark is skipped), at most 4 MiB.

    Raises:
        ConfigError: the file cannot be read, is larger, or is not UTF-8 text (a tar file).
    """
    try:
        with path.open("rb") as file:
            data = file.read(MAX_CONFIG_BYTES + 1)  # never all of /dev/zero
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
    if len(data) > MAX_CONFIG_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, the most a config file may "
            "hold: not a config file?"
        )
    if b"\0" in data:
        raise ConfigError(f"{path}: not a text file (it holds NUL bytes): not a config file?")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{path} line {line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the "
            "config as UTF-8"
        ) from None


def load_config(path: str | Path | None = None, overrides: Sequence[str] = ()) -> Config:
    """Load a config file (or the defaults), apply overrides and validate everything.

    Args:
        path: a YAML file whose keys mirror `Config`; None uses the defaults alone.
        overrides: `dotted.key=value` strings, applied in order after the file.

    Raises:
        ConfigError: one line naming the dotted key, its source and the allowed values.
    """
    tree: dict[str, Any] = {}
    sources: dict[str, str] = {}
    if path is not None:
        path = Path(path)
        text = read_config_text(path)
        try:
            loaded = parse_yaml(text, TextKeepingLoader)
        except YamlRefused as exc:
            raise ConfigError(f"{path}: {exc}") from None
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{path}{where}: not valid YAML") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path}: the top level must be a mapping of keys")
        tree = loaded
        _collect_sources(tree, str(path), "", sources)
        _move_keys(tree, sources)
    for text in overrides:
        _set_override(tree, sources, text)
    cfg = _build(Config, tree, sources, "")
    check_rules(cfg, sources)
    return cfg


def check_rules(cfg: Config, sources: Mapping[str, str] | None = None) -> None:
    """Refuse keys that cannot train together (`rules.broken_rule`), in one line naming
    them and, with `sources`, where each came from.

    Raises:
        ConfigError: the first rule `cfg` breaks.
    """
    message = broken_rule(cfg, sources)
    if message is not None:
        raise ConfigError(message)


def config_to_dict(obj: Any) -> Any:
    """The config tree as plain dicts/lists, with YAML key names (`checkpoint.async`)."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {_yaml_key(f): config_to_dict(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [config_to_dict(v) for v in obj]
    if isinstance(obj, dict):
        return {k: config_to_dict(v) for k, v in obj.items()}
    return obj


def config_to_yaml(cfg: Config) -> str:
    """The resolved config as YAML, loadable again with `load_config`."""
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False, default_flow_style=False)


def config_from_dict(tree: Mapping[str, Any], source: str = "saved config") -> Config:
    """Rebuild a `Config` from `config_to_dict` output (e.g. the copy saved in a run folder)."""
    sources: dict[str, str] = {"": source}
    own = copy.deepcopy(dict(tree))  # the caller's tree stays as it was
    _move_keys(own, sources)
    return _build(Config, own, sources, "")


def with_overrides(cfg: Config, overrides: Sequence[str]) -> Config:
    """A copy of `cfg` with `dotted.key=value` overrides applied and validated."""
    tree = config_to_dict(cfg)
    sources: dict[str, str] = {"": "resolved config"}
    for text in overrides:
        _set_override(tree, sources, text)
    return _build(Config, tree, sources, "")


def reference_rows() -> list[tuple[str, str, str]]:
    """(dotted key, default, help) for every key: docs/config-reference.md."""
    rows: list[tuple[str, str, str]] = []

    def walk(cls: type, prefix: str) -> None:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            tp = hints[f.name]
            dotted = f"{prefix}{_yaml_key(f)}"
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{dotted}.")  # type: ignore[arg-type]
                continue
            default = (
                f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            )
            help_text = str(f.metadata.get("help", ""))
            if "choices" in f.metadata:
                help_text += f" ({'|'.join(f.metadata['choices'])})"
            rows.append(
                (
                    dotted,
                    json.dumps(default),
                    help_text,
                )
            )

    walk(Config, "")
    return rows
