"""CSV/JSONL manifests: one row per sample, every column a member.

| column                                                   | member                                 |
|----------------------------------------------------------|----------------------------------------|
| `path` (`--path-column`)                                 | the image, named by its format: `jpg`, `png`, ... |
| `label` (`--label-column`)                               | `cls`: integers as they are; otherwise the sorted distinct values are the class names |
| a name with a file extension: `img.jpg`, `mask.png`, `depth.npy`, `tokens.u16` | the file the cell names, copied under the column's name |
| a name without one whose every cell names such a file: `mask` = `a/b.png` | the file, copied as `mask.png` (the extension from the file) |
| `cls`, `cls2`, `*.cls`                                   | the integer, as text                   |
| `txt`, `text`, `*.txt`                                   | the text, UTF-8                        |
| `json`, `*.json`                                         | JSON (a CSV cell is JSON text)         |
| any other column                                         | gathered into the sample's `json` member, as before |

Paths are relative to the manifest's folder, or absolute, or fsspec URLs. An empty cell
leaves the member out of that sample. A missing file, an unreadable one or a cell that does
not fit its column (`cls` = `abc`) is a bad sample: `--on-error fail` stops naming the row,
the column and the path; `skip` lists it in `skipped.txt`.
"""

from __future__ import annotations

import csv
import io
import json
import os
import posixpath
from collections.abc import Iterable
from typing import Any

import fsspec

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.fields import (
    FILE_EXTENSIONS,
    check_field_name,
    file_extension,
    last_extension,
    scalar_member,
)
from hpctrain.convert.sources.base import FieldRef, ListOptions, SampleRef, Source, sample_key
from hpctrain.data.index import redact_url
from hpctrain.errors import DataError

_SCALAR_EXTENSIONS = ("cls", "cls2", "txt", "text", "json")


def read_manifest_rows(src: str) -> list[dict[str, Any]]:
    """The rows of a CSV (header row) or JSONL manifest, as dicts."""
    try:
        with fsspec.open(src, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise ConvertError(f"{redact_url(src)}: manifest not found") from None
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte-order mark, which is not text
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConvertError(f"{redact_url(src)}:{line}: not valid UTF-8") from None
    if _is_csv(src):
        return list(csv.DictReader(io.StringIO(text)))
    rows = []
    for line_number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise ConvertError(f"{redact_url(src)}:{line_number}: not a JSON object") from None
        if not isinstance(row, dict):
            raise ConvertError(f"{redact_url(src)}:{line_number}: not a JSON object")
        rows.append(row)
    return rows


def _is_csv(src: str) -> bool:
    return src.lower().split("?", 1)[0].endswith(".csv")


def label_class_names(values: Iterable[Any]) -> tuple[str, ...]:
    """The class names of a label column's values: () when every value is an integer (the
    labels are those integers), else the sorted distinct values (labels are positions).

    The one rule of every tabular source (manifests, Arrow/parquet).
    """
    present = {v for v in values if v not in (None, "")}
    if all(
        (isinstance(v, int) and not isinstance(v, bool))
        or (isinstance(v, str) and v.strip().lstrip("-").isdigit())
        for v in present
    ):
        return ()
    return tuple(sorted({str(v) for v in present}))


def _labels(
    rows: list[dict[str, Any]], label_column: str
) -> tuple[list[int | None], tuple[str, ...]]:
    """Each row's label and the class names (`label_class_names`)."""
    values = [row.get(label_column) for row in rows]
    class_names = label_class_names(values)
    if not class_names:
        return [None if v in (None, "") else int(v) for v in values], ()
    position = {name: i for i, name in enumerate(class_names)}
    return [None if v in (None, "") else position[str(v)] for v in values], class_names


def column_kind(column: str, values: list[Any]) -> str:
    """ "file" (cells are paths to copy), "member" (a scalar member) or "json" (gathered)."""
    ext = last_extension(column)
    if ext in _SCALAR_EXTENSIONS:
        return "member"
    if "." in column:
        return "file" if ext in FILE_EXTENSIONS else "json"
    cells = [v for v in values if v not in (None, "")]
    if cells and all(isinstance(v, str) and file_extension(v) in FILE_EXTENSIONS for v in cells):
        return "file"
    return "json"


def _resolve(base: str, path: str) -> str:
    return path if "://" in path or path.startswith("/") else posixpath.join(base, path)


def list_manifest(src: str, options: ListOptions) -> Source:
    """List a CSV (header row) or JSONL manifest; the column rules are in the module doc (the
    image path column `options.path_column`, the label column `options.label_column`)."""
    path_column, label_column = options.path_column, options.label_column
    rows = read_manifest_rows(src)
    if not rows:
        raise ConvertError(f"{redact_url(src)}: empty manifest")
    name = redact_url(src)
    columns = list(dict.fromkeys(column for row in rows for column in row))
    for flag, column, default in (
        ("--path-column", path_column, "path"),
        ("--label-column", label_column, "label"),
    ):
        if column != default and column not in columns:
            raise ConvertOptionError(
                f"{flag} {column}: {name} has no column {column!r}; columns: {', '.join(columns)}"
            )
    has_path = path_column in columns
    if has_path:
        for number, row in enumerate(rows, 1):
            if path_column not in row:
                raise ConvertError(f"{name}: row {number} has no {path_column!r} column")
    kinds = {
        column: column_kind(column, [row.get(column) for row in rows])
        for column in columns
        if column not in (path_column, label_column)
    }
    if not has_path and "file" not in kinds.values():
        raise ConvertError(
            f"{name}: no file column: expected a {path_column!r} column or columns of paths "
            f"(img.jpg, mask.png, depth.npy, ...); columns: {', '.join(columns)}"
        )
    _check_member_names(name, kinds, has_label=label_column in columns)
    labels, class_names = _labels(rows, label_column)
    base = src.rsplit("/", 1)[0] if "/" in src else "."
    samples = []
    for i, row in enumerate(rows):
        origin = f"{name} row {i + 1}"
        fields, error = _row_fields(row, kinds, base, csv_text=_is_csv(src))
        gathered = {
            k: v
            for k, v in row.items()
            if k not in (path_column, label_column) and kinds[k] == "json"
        }
        url = _resolve(base, str(row[path_column])) if has_path else ""
        samples.append(
            SampleRef(
                key=sample_key(i),
                url=url,
                size=0,
                label=labels[i],
                meta=json.dumps(gathered, sort_keys=True, separators=(",", ":"))
                if gathered
                else None,
                fields=fields,
                origin=origin,
                error=error,
                source=str(row[path_column]) if has_path else "",
            )
        )
    return Source("manifest", tuple(_with_sizes(samples)), class_names)


def _check_member_names(source: str, kinds: dict[str, str], *, has_label: bool) -> None:
    """Refuse columns whose members would collide or could not be read back."""
    owners: dict[str, str] = {"cls": "the label column"} if has_label else {}
    if "json" in kinds.values():
        owners["json"] = "the columns gathered into json"
    for column, kind in kinds.items():
        if kind == "json":
            continue
        field = check_field_name(column, f"{source}: column {column!r}")
        if field in owners:
            raise DataError(
                f"{source}: column {column!r} and {owners[field]} would both write the member "
                f"{field!r}; rename one (e.g. {column}.txt)"
            )
        owners[field] = f"column {column!r}"


def _row_fields(
    row: dict[str, Any], kinds: dict[str, str], base: str, *, csv_text: bool
) -> tuple[tuple[FieldRef, ...], str]:
    """The members of a row's file and scalar columns, and the first error found ("" if none)."""
    fields = []
    for column, kind in kinds.items():
        value = row.get(column)
        if kind == "json" or value in (None, ""):
            continue
        field = column.lower()
        if kind == "file":
            if not isinstance(value, str):
                return (), f"column {column!r}: {value!r} is not a path"
            url = _resolve(base, value)
            if "." not in column and file_extension(value):
                field = f"{field}.{file_extension(value)}"
            fields.append(FieldRef(field, url=url, column=column))
            continue
        try:
            data = scalar_member(column, value, csv_text=csv_text)
        except ValueError as exc:
            return (), f"column {column!r}: {exc}"
        assert data is not None  # "member" columns are exactly those scalar_member writes
        fields.append(FieldRef(field, data=data, size=len(data), column=column))
    return tuple(fields), ""


def _with_sizes(samples: list[SampleRef]) -> list[SampleRef]:
    """The samples with the sizes of their files filled in (they plan `--shard-size`)."""
    urls = [s.url for s in samples if s.url] + [f.url for s in samples for f in s.fields if f.url]
    size_of = dict(zip(urls, file_sizes(urls), strict=True))
    out = []
    for sample in samples:
        fields = tuple(
            FieldRef(f.name, url=f.url, size=size_of[f.url], column=f.column) if f.url else f
            for f in sample.fields
        )
        out.append(
            SampleRef(
                key=sample.key,
                url=sample.url,
                size=size_of.get(sample.url, 0),
                label=sample.label,
                meta=sample.meta,
                fields=fields,
                origin=sample.origin,
                error=sample.error,
                source=sample.source,
            )
        )
    return out


def file_sizes(urls: list[str]) -> list[int]:
    """Sizes for planning `--shard-size` (0 where unknown: the file is then judged when read)."""
    sizes = []
    for url in urls:
        if "://" not in url:
            try:
                sizes.append(os.stat(url).st_size)
            except OSError:
                sizes.append(0)
            continue
        try:
            fs, path = fsspec.core.url_to_fs(url)
            sizes.append(int(fs.size(path) or 0))
        except (OSError, ValueError):
            sizes.append(0)
    return sizes
