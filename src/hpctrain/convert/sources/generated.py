"""Generated sources: samples made by Python code (`pkg.mod:fn`), spooled once, then sharded.

`hpctrain convert mypkg.data:make_dataset DEST --arg split=train` imports `mypkg.data` (the
current folder first on `sys.path`, as `python -m` does), calls `make_dataset(split="train")`
and writes what it returns: a map-style `torch.utils.data.Dataset` (`__len__` +
`__getitem__`, read in index order) or any iterable, of dict samples. Each value becomes a
member by its type and field name (`hpctrain.convert.fields`); a `__key__` or `key` field
names the sample, otherwise the key is its position.

Why spool: the samples are encoded once, in the main process and in order, into a local tar
(the spool); the plan then treats it like existing shards. So the output is the same for any
`--workers` (the writers only copy bytes), `--shard-size` plans from real encoded sizes, and
the dataset is read exactly once even when it is an iterator. The spool lives in a temporary
folder deleted with the conversion.

Trust: this imports and runs the code SRC names, which the user typed on their own command
line; nothing read from an index or a manifest is ever imported.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator
from typing import Any, BinaryIO

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.fields import check_field_name, encode_value
from hpctrain.convert.sources.base import ListOptions, SampleRef, Source, sample_key, unsafe_key
from hpctrain.convert.tar import ShardTarWriter, member_header
from hpctrain.errors import DataError

KEY_FIELDS = ("__key__", "key")

# `package.module:callable`: a Python source. Only ever matched against SRC as the user typed it
# on the command line: nothing read from an index or a manifest is imported.
_CALLABLE = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*")


def is_python_spec(src: str) -> bool:
    """SRC names a Python callable (`pkg.module:function`), not a path."""
    return bool(_CALLABLE.fullmatch(src)) and not os.path.exists(src)


class Spool:
    """Encoded samples written once to a local tar; `SampleRef`s locate their members in it.

    Args:
        folder: where the spool file goes (a temporary folder of the conversion).
        name: the source, as messages name it.
    """

    def __init__(self, folder: str, name: str) -> None:
        if not folder:
            raise ConvertError(
                f"{name}: a generated source needs a spool folder (ListOptions.spool_dir)"
            )
        self.name = name
        self.path = os.path.join(folder, f"spool-{len(os.listdir(folder)):03d}.tar")
        self._file: BinaryIO = open(self.path, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in finish)
        self._writer = ShardTarWriter(self._file)
        self._samples: list[SampleRef] = []
        self._index_of_key: dict[str, int] = {}

    def add(self, key: str, members: list[tuple[str, bytes]], origin: str, error: str = "") -> None:
        """Append one sample (`error`: a bad sample, raised when written under `--on-error`)."""
        if key in self._index_of_key:
            raise DataError(
                f"{self.name}: samples {self._index_of_key[key]} and {len(self._samples)} "
                f"have the same key {key!r}"
            )
        self._index_of_key[key] = len(self._samples)
        if error or not members:
            self._samples.append(
                SampleRef(key, "", 0, origin=origin, error=error or "no fields to write")
            )
            return
        located = []
        start = self._writer.num_bytes
        for field, data in members:
            offset = self._writer.num_bytes + len(member_header(f"{key}.{field}", len(data)))
            self._writer.add(f"{key}.{field}", data)
            located.append((field, offset, len(data)))
        self._samples.append(
            SampleRef(
                key,
                self.path,
                self._writer.num_bytes - start,
                label=_label(members),
                members=tuple(located),
                origin=origin,
            )
        )

    def abort(self) -> None:
        """Close the spool file after a failure (the folder is deleted with the conversion)."""
        self._file.close()

    def last(self) -> SampleRef:
        """The sample added last."""
        return self._samples[-1]

    def finish(self, *, allow_empty: bool = False) -> tuple[SampleRef, ...]:
        """Close the spool file; the samples in the order they were added (`allow_empty`:
        none is no error: a part of a conversion may hold none)."""
        self._writer.finish()
        self._file.close()
        if not self._samples and not allow_empty:
            raise DataError(f"{self.name}: no samples")
        return tuple(self._samples)


def _label(members: list[tuple[str, bytes]]) -> int | None:
    """The `cls` member's value: `--val-fraction` stratifies by it (it is written as a member)."""
    for field, data in members:
        if field == "cls":
            with contextlib.suppress(ValueError):
                return int(data)
    return None


def check_key(value: Any, where: str) -> str:
    """A sample key from a `__key__`/`key` field: non-empty text without dots or whitespace."""
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise DataError(f"{where}: key {value!r} is not a str or an int")
    key = str(value)
    # the loader splits a member name at the first dot after the last slash: the key's end
    if not key or "." in key.rsplit("/", 1)[-1] or any(c.isspace() for c in key):
        raise DataError(f"{where}: key {key!r} is empty, has a dot or whitespace")
    if unsafe_key(key):  # "../../etc/x" would be a tar member outside the folder
        raise DataError(
            f"{where}: key {key!r} has a '..', '.' or empty part or is absolute: its members "
            "would lie outside the folder"
        )
    return key


def parse_args(pairs: Iterable[tuple[str, str]]) -> dict[str, Any]:
    """`--arg k=v` values: JSON when they parse as JSON (10, 0.5, true, [1,2]), else text."""
    kwargs: dict[str, Any] = {}
    for key, text in pairs:
        try:
            kwargs[key] = json.loads(text)
        except ValueError:
            kwargs[key] = text
    return kwargs


@contextlib.contextmanager
def _cwd_on_path() -> Iterator[None]:
    """The current folder first on `sys.path` while importing, as `python -m` has it."""
    cwd = os.getcwd()
    added = cwd not in sys.path
    if added:
        sys.path.insert(0, cwd)
    try:
        yield
    finally:
        if added:
            with contextlib.suppress(ValueError):
                sys.path.remove(cwd)


def load_callable(spec: str) -> Any:
    """The object `package.module:name` names (a ConvertOptionError naming it when it cannot)."""
    module_name, _, attribute = spec.partition(":")
    with _cwd_on_path():
        try:
            obj: Any = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConvertOptionError(f"{spec}: cannot import {module_name!r}: {exc}") from None
    for part in attribute.split("."):
        if not hasattr(obj, part):
            raise ConvertOptionError(f"{spec}: {module_name!r} has no attribute {attribute!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ConvertOptionError(f"{spec}: {attribute!r} is a {type(obj).__name__}, not a callable")
    return obj


def iter_dataset(dataset: Any, spec: str) -> Iterator[Any]:
    """The samples of a map-style Dataset (by index, in order) or of an iterable."""
    if isinstance(dataset, (dict, str, bytes)) or dataset is None:
        raise DataError(
            f"{spec}: returned a {type(dataset).__name__}; expected an iterable or a map-style "
            "Dataset of dict samples"
        )
    if hasattr(dataset, "__getitem__") and not hasattr(dataset, "__iter__"):
        if not hasattr(dataset, "__len__"):
            raise DataError(f"{spec}: a map-style Dataset without __len__ cannot be listed")
        return (dataset[i] for i in range(len(dataset)))
    if not hasattr(dataset, "__iter__"):
        raise DataError(
            f"{spec}: returned a {type(dataset).__name__}, neither iterable nor a map-style Dataset"
        )
    return iter(dataset)


def encode_sample(sample: Any, position: int, spec: str) -> tuple[str, list[tuple[str, bytes]]]:
    """(key, members) of one Python sample (see `hpctrain.convert.fields` for the rules)."""
    where = f"{spec}: sample {position}"
    if not isinstance(sample, dict):
        raise DataError(f"{where} is a {type(sample).__name__}, not a dict of fields")
    key = sample_key(position)
    members: list[tuple[str, bytes]] = []
    names: dict[str, str] = {}
    for name, value in sample.items():
        if name in KEY_FIELDS:
            key = check_key(value, where)
            continue
        if not isinstance(name, str):
            raise DataError(f"{where}: field name {name!r} is not a str")
        field = check_field_name(name, where)
        try:
            encoded = encode_value(field, value)
        except ValueError as exc:
            raise DataError(f"{where}, field {name!r}: {exc}") from None
        if encoded is None:
            continue
        if encoded[0] in names:
            raise DataError(
                f"{where}: fields {names[encoded[0]]!r} and {name!r} both become member {encoded[0]!r}"
            )
        names[encoded[0]] = name
        members.append(encoded)
    return key, members


def list_python(spec: str, options: ListOptions) -> Source:
    """Call `spec` with `options.args`, encode every sample it gives into a spool, list them."""
    function = load_callable(spec)
    dataset = function(**parse_args(options.args))
    spool = Spool(options.spool_dir, spec)
    try:
        for position, sample in enumerate(iter_dataset(dataset, spec)):
            key, members = encode_sample(sample, position, spec)
            spool.add(key, members, f"{spec} sample {position}")
    except BaseException:
        spool.abort()
        raise
    return Source("python", spool.finish())
