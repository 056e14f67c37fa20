"""Arrow and parquet sources: a Hugging Face `save_to_disk` folder, parquet files or globs.

Needs pyarrow (`pip install 'hpctrain[arrow]'`). SRC is one of

- a `save_to_disk` folder: `state.json` lists its Arrow files (IPC streams), and
  `dataset_info.json` its features (which columns are `Image`s, which are `ClassLabel`s);
- a `.parquet` or `.arrow` file, a glob of them (`data/train-*.parquet`), or a folder of them.

Every column becomes a member, as in manifests: `--column name=field` renames a column
(`--column image=img.jpg`), `--column name=` leaves it out. Values, by the field's name and
the value's type:

- a file struct {bytes, path} (the `Image`, `Audio`, `Video` features): its encoded bytes, as
  they are, under the field's name (`img.jpg`), or else the field name plus the image's format
  (`image.png`) or the extension of its path (`audio.wav`); `bytes` null: the file at `path`
  (relative to the source folder);
- binary: the bytes (a field name without an extension gets the image format when the bytes
  are an image);
- a single `ClassLabel` column is written as `cls` unless `--column` says otherwise, and its
  names become the index's class names; the label column (`--label-column`, default `label`)
  is `cls` by the manifest rule: integers as they are, else the sorted distinct values are the
  class names (read from every row before the first is written);
- scalars as in manifests: `cls`, `cls2`, `*.cls` integers; `txt`, `text`, `*.txt` text;
  `json`, `*.json` JSON; every other column (numbers, strings, lists) gathered into `json`.

Rows are read batch by batch and encoded into the conversion's spool (see `generated`), so
a dataset larger than memory converts, and the output is the same for any `--workers`. A
missing image file or a value that does not fit its field is a bad sample (`--on-error`).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import fsspec

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.fields import (
    check_field_name,
    file_extension,
    json_bytes,
    scalar_member,
)
from hpctrain.convert.sources.base import (
    ListOptions,
    SampleRef,
    Source,
    full_url,
    image_extension,
    read_url,
    sample_key,
)
from hpctrain.convert.sources.generated import Spool, check_key
from hpctrain.convert.sources.manifest import label_class_names
from hpctrain.data.index import redact_url
from hpctrain.errors import DataError, install_hint

BATCH_ROWS = 256


def import_pyarrow() -> Any:
    try:
        import pyarrow
        import pyarrow.ipc
        import pyarrow.parquet
    except ImportError:
        raise ConvertOptionError(
            f"reading Arrow/parquet needs pyarrow: {install_hint('arrow')}"
        ) from None
    return pyarrow


@dataclass(frozen=True)
class _Column:
    name: str  # in the table
    field: str  # the member it becomes (or the key in the gathered json)
    kind: str  # "file" (a {bytes, path} struct) | "binary" | "value" | "key" | "label"
    classes: tuple[str, ...] = ()  # "label": the class names its text values are positions in


def arrow_files(src: str) -> tuple[list[str], dict[str, Any], str]:
    """(file URLs, Hugging Face features or {}, the folder image paths are relative to)."""
    fs, path = fsspec.core.url_to_fs(src)
    shown = redact_url(src)
    if any(ch in src for ch in "*?["):
        found = sorted(fs.glob(path))
        if not found:
            raise ConvertError(f"{shown}: no files match")
        return [full_url(fs, p) for p in found], {}, posixpath.dirname(src)
    if not fs.exists(path):
        raise ConvertError(f"{shown}: source not found")
    if not fs.isdir(path):
        return [src], {}, posixpath.dirname(src)
    base = src.rstrip("/")
    if fs.exists(posixpath.join(path, "dataset_dict.json")):
        splits = json.loads(fs.cat_file(posixpath.join(path, "dataset_dict.json"))).get(
            "splits", []
        )
        raise ConvertError(
            f"{shown}: a DatasetDict with splits {', '.join(map(str, splits))}; convert one: "
            f"{shown}/{splits[0] if splits else '<split>'}"
        )
    if fs.exists(posixpath.join(path, "state.json")):
        try:
            state = json.loads(fs.cat_file(posixpath.join(path, "state.json")))
            names = [entry["filename"] for entry in state["_data_files"]]
            info_path = posixpath.join(path, "dataset_info.json")
            info = json.loads(fs.cat_file(info_path)) if fs.exists(info_path) else {}
        except (ValueError, KeyError, TypeError) as exc:
            raise ConvertError(f"{shown}: unreadable state.json/dataset_info.json: {exc}") from None
        for name in names:
            if "/" in name or name.startswith("."):
                raise ConvertError(f"{shown}: state.json names a file outside the folder: {name!r}")
        return [f"{base}/{name}" for name in names], info.get("features") or {}, base
    found = sorted(p for p in fs.ls(path, detail=False) if p.endswith((".arrow", ".parquet")))
    if not found:
        raise ConvertError(f"{shown}: no .arrow or .parquet files")
    return [full_url(fs, p) for p in found], {}, base


def iter_batches(url: str, columns: list[str] | None = None) -> Iterator[Any]:
    """Record batches of a parquet file, an Arrow IPC stream (save_to_disk) or an Arrow file
    (`columns`: only those, where the format can read them alone)."""
    pa = import_pyarrow()
    with fsspec.open(url, "rb") as f:
        try:
            if url.split("?", 1)[0].endswith(".parquet"):
                parquet = pa.parquet.ParquetFile(f)
                yield from parquet.iter_batches(batch_size=BATCH_ROWS, columns=columns)
                return
            try:
                reader = pa.ipc.open_stream(f)
            except pa.ArrowInvalid:  # the random-access file format, not a stream
                f.seek(0)
                file_reader = pa.ipc.open_file(f)
                for i in range(file_reader.num_record_batches):
                    yield file_reader.get_batch(i)
                return
            yield from reader
        except pa.ArrowException as exc:
            raise ConvertError(f"{redact_url(url)}: not readable as Arrow/parquet: {exc}") from None


def _is_file_struct(pa: Any, type_: Any) -> bool:
    return bool(
        pa.types.is_struct(type_)
        and {type_.field(i).name for i in range(type_.num_fields)} == {"bytes", "path"}
    )


def plan_columns(
    src: str,
    schema: Any,
    features: dict[str, Any],
    mapping: Iterable[tuple[str, str]],
    label_column: str = "label",
) -> tuple[list[_Column], tuple[str, ...]]:
    """Which column becomes which field, and the class names of the column written as `cls`.

    Text class names of a plain label column are found later (`_label_classes`: every row).
    """
    pa = import_pyarrow()
    shown = redact_url(src)
    renames = dict(mapping)
    for name in renames:
        if name not in schema.names:
            raise ConvertOptionError(
                f"--column {name}={renames[name]}: {shown} has no column {name!r}; "
                f"columns: {', '.join(schema.names)}"
            )
    if label_column != "label" and label_column not in schema.names:
        raise ConvertOptionError(
            f"--label-column {label_column}: {shown} has no column {label_column!r}; "
            f"columns: {', '.join(schema.names)}"
        )
    class_labels = [n for n in schema.names if (features.get(n) or {}).get("_type") == "ClassLabel"]
    if len(class_labels) == 1 and class_labels[0] not in renames and "cls" not in schema.names:
        renames[class_labels[0]] = "cls"
    # The label column is `cls`, as in manifests (unless --column says otherwise).
    plain_label = label_column in schema.names and label_column not in renames
    if plain_label:
        renames[label_column] = "cls"
    class_names: tuple[str, ...] = ()
    columns = []
    owners: dict[str, str] = {}  # member -> the column that writes it
    gathered = []
    for name in schema.names:
        field = renames.get(name, name)
        if field == "":
            continue
        if name == "__key__":
            columns.append(_Column(name, name, "key"))
            continue
        type_ = schema.field(name).type
        feature = features.get(name) or {}
        if _is_file_struct(pa, type_):
            kind = "file"
        elif pa.types.is_binary(type_) or pa.types.is_large_binary(type_):
            kind = "binary"
        elif (
            plain_label
            and name == label_column
            and feature.get("_type") != "ClassLabel"
            and not pa.types.is_nested(type_)  # a list is no label: each row a bad sample
        ):
            kind = "label"
        else:
            kind = "value"
        field = check_field_name(field, f"{shown}: column {name!r}")
        if kind in ("value", "label") and scalar_member(field, 0, csv_text=False) is None:
            gathered.append(name)
        elif field in owners:
            raise ConvertOptionError(
                f"{shown}: columns {owners[field]!r} and {name!r} would both write the member "
                f"{field!r}; rename one with --column"
            )
        else:
            owners[field] = name
        if field == "cls" and feature.get("_type") == "ClassLabel":
            class_names = tuple(str(n) for n in feature.get("names") or ())
        columns.append(_Column(name, field, kind))
    if gathered and "json" in owners:
        raise ConvertOptionError(
            f"{shown}: column {owners['json']!r} writes the json member that columns "
            f"{', '.join(gathered)} are gathered into; rename one with --column"
        )
    return columns, class_names


def _named(column: _Column, data: bytes, path: str = "") -> tuple[str, bytes]:
    """The member of bytes from a file struct or binary column, named as the module doc says."""
    if "." in column.field:
        return column.field, data
    ext = image_extension(data) or file_extension(path)
    return (f"{column.field}.{ext}" if ext else column.field), data


def encode_row(
    row: dict[str, Any], columns: list[_Column], base: str
) -> tuple[str | None, list[tuple[str, bytes]]]:
    """(key from `__key__` or None, members) of one row. ValueError: a bad value, named."""
    key = None
    members: list[tuple[str, bytes]] = []
    gathered: dict[str, Any] = {}
    for column in columns:
        value = row.get(column.name)
        if value is None:
            continue
        try:
            if column.kind == "key":
                key = check_key(value, f"column {column.name!r}")
            elif column.kind == "file":
                data = value.get("bytes")
                path = value.get("path") or ""
                if data is None:
                    if not path:
                        raise ValueError("neither bytes nor a path")
                    url = path if "://" in path or path.startswith("/") else f"{base}/{path}"
                    try:
                        data = read_url(url)
                    except OSError as exc:
                        raise ValueError(f"cannot read {url}: {exc.strerror or exc}") from None
                members.append(_named(column, data, path))
            elif column.kind == "binary":
                members.append(_named(column, bytes(value)))
            elif column.kind == "label" and column.classes:
                members.append((column.field, str(column.classes.index(str(value))).encode()))
            else:
                data = scalar_member(column.field, value, csv_text=False)
                if data is None:
                    gathered[column.field] = value
                else:
                    members.append((column.field, data))
        except (ValueError, DataError) as exc:
            raise ValueError(f"column {column.name!r}: {exc}") from None
    if gathered:
        try:
            members.append(("json", json_bytes(gathered)))
        except ValueError as exc:
            raise ValueError(f"columns gathered into json: {exc}") from None
    return key, members


def _label_classes(
    columns: list[_Column], files: list[str]
) -> tuple[list[_Column], tuple[str, ...]]:
    """The columns with the class names of a text label column (read from every file first,
    as manifests do: sorted distinct values; all integers: no names, the integers are labels)."""
    labels = [c for c in columns if c.kind == "label"]
    if not labels:
        return columns, ()
    name = labels[0].name
    values = {
        v for url in files for b in iter_batches(url, [name]) for v in b.column(name).to_pylist()
    }
    classes = label_class_names(values)
    return [
        _Column(c.name, c.field, c.kind, classes) if c.kind == "label" else c for c in columns
    ], classes


@dataclass
class _Columns:
    """The columns of a source, planned from the first batch read (class names over every
    file: `_label_classes`); a later batch with other column names is refused."""

    src: str
    options: ListOptions
    files: list[str]
    features: dict[str, Any]
    planned: list[_Column] | None = None
    class_names: tuple[str, ...] = ()
    names: list[str] = field(default_factory=list)

    def of(self, batch: Any, url: str) -> list[_Column]:
        if self.planned is None:
            planned, class_names = plan_columns(
                self.src, batch.schema, self.features, self.options.columns,
                self.options.label_column,
            )  # fmt: skip
            self.planned, found = _label_classes(planned, self.files)
            self.class_names = found or class_names
            self.names = batch.schema.names
        elif batch.schema.names != self.names:
            raise ConvertError(
                f"{redact_url(url)}: columns {', '.join(batch.schema.names)} differ "
                f"from the first file's ({', '.join(self.names)})"
            )
        return self.planned


def list_arrow(src: str, options: ListOptions) -> Source:
    """Read every row of the Arrow/parquet source into the spool (see module doc); the
    columns as `options.columns` renames them, the label column `options.label_column`."""
    pa = import_pyarrow()
    files, features, base = arrow_files(src)
    shown = redact_url(src)
    spool = Spool(options.spool_dir, shown)
    plan = _Columns(src, options, files, features)
    position = 0
    try:
        for url in files:
            for batch in iter_batches(url):
                columns = plan.of(batch, url)
                for row in batch.to_pylist():
                    origin = f"{shown} row {position + 1}"
                    try:
                        key, members = encode_row(row, columns, base)
                        spool.add(key or sample_key(position), members, origin)
                    except ValueError as exc:
                        spool.add(sample_key(position), [], origin, str(exc))
                    position += 1
    except pa.ArrowException as exc:
        spool.abort()
        raise ConvertError(f"{shown}: {exc}") from None
    except BaseException:
        spool.abort()
        raise
    return Source("arrow", spool.finish(), plan.class_names)


# -- conversions in parts (`hpctrain.convert.parts`) ------------------------------------------


@dataclass(frozen=True)
class ArrowUnit:
    """What one part of a conversion reads of an Arrow/parquet source: a row group of a
    parquet file, or a whole Arrow file (its batches cannot be reached without the ones
    before)."""

    url: str
    row_group: int | None = None


def arrow_units(src: str) -> list[ArrowUnit]:
    """Every unit of the source, in source order (parquet footers read: cheap)."""
    pa = import_pyarrow()
    units = []
    for url in arrow_files(src)[0]:
        if not url.split("?", 1)[0].endswith(".parquet"):
            units.append(ArrowUnit(url))
            continue
        with fsspec.open(url, "rb") as f:
            try:
                groups = pa.parquet.ParquetFile(f).num_row_groups
            except pa.ArrowException as exc:
                raise ConvertError(f"{redact_url(url)}: not readable as parquet: {exc}") from None
        units += [ArrowUnit(url, g) for g in range(groups)]
    return units


def _unit_batches(unit: ArrowUnit) -> Iterator[Any]:
    if unit.row_group is None:
        yield from iter_batches(unit.url)
        return
    pa = import_pyarrow()
    with fsspec.open(unit.url, "rb") as f:
        try:
            parquet = pa.parquet.ParquetFile(f)
            yield from parquet.iter_batches(batch_size=BATCH_ROWS, row_groups=[unit.row_group])
        except pa.ArrowException as exc:
            raise ConvertError(f"{redact_url(unit.url)}: not readable as parquet: {exc}") from None


@dataclass(frozen=True)
class PartRow:
    """A row one part encoded into its spool; its place in the whole source (and so its
    default key and the row number messages give) is known once every part has listed."""

    unit: int  # the unit's number in `arrow_units`
    row: int  # its row in the unit
    key: str | None  # from the `__key__` column; None: the key of its position
    sample: SampleRef  # spooled; key and origin are placeholders until `place_rows`


@dataclass(frozen=True)
class ArrowPart:
    rows: list[PartRow]
    unit_rows: dict[int, int]  # rows of each unit this part read
    class_names: tuple[str, ...]
    columns: list[str]  # of the first batch read (every part's must agree)


def list_arrow_part(
    src: str, options: ListOptions, units: list[ArrowUnit], mine: range
) -> ArrowPart:
    """Encode the rows of units `mine` into the spool (`options.spool_dir`), as `list_arrow`
    encodes every row; the columns and class names are decided over the whole source as
    there (`_label_classes` reads the label column of every file)."""
    pa = import_pyarrow()
    files, features, base = arrow_files(src)
    shown = redact_url(src)
    spool = Spool(options.spool_dir, shown)
    plan = _Columns(src, options, files, features)
    rows: list[PartRow] = []
    unit_rows: dict[int, int] = {}
    try:
        for u in mine:
            count = 0
            for batch in _unit_batches(units[u]):
                columns = plan.of(batch, units[u].url)
                for row in batch.to_pylist():
                    placeholder = f"u{u}-{count}"  # unique in the spool; the real key later
                    try:
                        key, members = encode_row(row, columns, base)
                        spool.add(placeholder, members, "")
                    except ValueError as exc:
                        key = None
                        spool.add(placeholder, [], "", str(exc))
                    rows.append(PartRow(u, count, key, spool.last()))
                    count += 1
            unit_rows[u] = count
    except pa.ArrowException as exc:
        spool.abort()
        raise ConvertError(f"{shown}: {exc}") from None
    except BaseException:
        spool.abort()
        raise
    spool.finish(allow_empty=True)
    return ArrowPart(rows, unit_rows, plan.class_names, plan.names)


def place_rows(src: str, rows: list[PartRow], unit_rows: dict[int, int]) -> tuple[SampleRef, ...]:
    """Every part's rows in source order, keyed and named as `list_arrow` keys them: the
    `__key__` column, else the row's position in the whole source."""
    shown = redact_url(src)
    offsets, total = {}, 0
    for u in sorted(unit_rows):
        offsets[u], total = total, total + unit_rows[u]
    samples: list[SampleRef] = []
    seen: dict[str, int] = {}
    for r in sorted(rows, key=lambda r: (r.unit, r.row)):
        position = offsets[r.unit] + r.row
        key = r.key or sample_key(position)
        if key in seen:  # as the spool of one conversion says it
            raise DataError(
                f"{shown}: samples {seen[key]} and {len(samples)} have the same key {key!r}"
            )
        seen[key] = len(samples)
        samples.append(replace(r.sample, key=key, origin=f"{shown} row {position + 1}"))
    if not samples:
        raise DataError(f"{shown}: no samples")
    return tuple(samples)
