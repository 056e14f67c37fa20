"""`hpctrain inspect`: describe shards and, with `verify`, check every byte and decode every sample.

Works on any WebDataset shards, not only ours: an index (or a folder holding one, or the
`train/` + `val/` layout of `convert --val-fraction`), a folder of `.tar` files, a brace
pattern or a single `.tar`. Without an index there is nothing to check sizes and digests
against, but every member is still read and decoded.
"""

from __future__ import annotations

import hashlib
import io
import json
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec

from hpctrain.convert.fields import IMAGE_EXTENSIONS
from hpctrain.convert.parallel import process_pool
from hpctrain.convert.sources import ConvertError, shard_urls
from hpctrain.data.index import INDEX_NAME, ShardIndex, read_index, redact_url
from hpctrain.data.stream import pipe_label


@dataclass
class ShardReport:
    url: str  # as shown: relative to the index folder when there is an index
    expected_samples: int | None  # from the index
    expected_bytes: int | None
    expected_sha256: str = ""
    num_samples: int = 0
    num_bytes: int = 0
    errors: list[str] = field(default_factory=list)
    class_histogram: Counter[int] = field(default_factory=Counter)
    sample_keys: list[str] = field(default_factory=list)  # the first few


@dataclass
class DatasetReport:
    """What `inspect` found for one index or shard set."""

    source: str  # redacted
    index_url: str | None
    class_names: tuple[str, ...]
    shards: list[ShardReport]
    verified: bool
    class_histogram: Counter[int] = field(default_factory=Counter)
    sample_keys: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)  # every problem, each naming shard and member

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.shards)

    def to_json(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "index": self.index_url,
            "verified": self.verified,
            "ok": not self.errors,
            "num_samples": self.num_samples,
            "num_bytes": self.num_bytes,
            "num_shards": len(self.shards),
            "class_names": list(self.class_names),
            "class_histogram": {str(k): v for k, v in sorted(self.class_histogram.items())},
            "sample_keys": self.sample_keys,
            "shards": [
                {
                    "url": s.url,
                    "num_samples": s.num_samples,
                    "num_bytes": s.num_bytes,
                    "ok": not s.errors,
                }
                for s in self.shards
            ],
            "errors": self.errors,
        }


class _HashingReader(io.RawIOBase):
    """A read-only stream that hashes and counts what passes through it."""

    def __init__(self, raw: Any) -> None:
        self._raw = raw
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        data = self._raw.read(len(buffer))
        n = len(data)
        buffer[:n] = data
        self.sha256.update(data)
        self.num_bytes += n
        return n

    def drain(self) -> None:
        while self._raw is not None and self.read(1 << 20):
            pass


def resolve(spec: str) -> list[tuple[str, ShardIndex | None, list[str]]]:
    """(display name, index or None, absolute shard URLs) for each shard set `spec` names.

    Every form the loader reads, and more: an index under any `.json` name, a folder holding
    one (or `train/` and `val/`), a folder of `.tar` files, a brace pattern, one `.tar`.
    `pipe:` commands are refused: inspecting reads files and URLs, it runs no command.
    """
    if spec.startswith("pipe:"):
        raise ConvertError(
            f"{pipe_label(spec)}: inspect does not run pipe: commands; inspect the files or "
            "URLs the command reads (training runs them with data.allow_pipe: true)"
        )
    if spec.endswith(".json"):
        index = read_index(spec)
        return [(spec, index, [index.shard_url(i) for i in range(len(index.shards))])]
    fs, path = fsspec.core.url_to_fs(spec)
    if "{" not in spec and fs.isdir(path):
        base = spec.rstrip("/")
        if fs.exists(posixpath.join(path, INDEX_NAME)):
            return resolve(f"{base}/{INDEX_NAME}")
        splits = [s for s in ("train", "val") if fs.exists(posixpath.join(path, s, INDEX_NAME))]
        if splits:
            return [item for s in splits for item in resolve(f"{base}/{s}/{INDEX_NAME}")]
    elif "{" not in spec and not spec.endswith(".tar") and not fs.exists(path):
        raise ConvertError(f"{redact_url(spec)}: not found")
    urls, _ = shard_urls(spec)
    return [(spec, None, urls)]


def _check_member(
    shard: str, name: str, ext: str, data: bytes, report: ShardReport, verify: bool
) -> int | None:
    """Check one member; return its label for `.cls` members."""
    if ext == "cls":
        try:
            return int(data.decode().strip())
        except ValueError:
            report.errors.append(f"{shard}: {name}: .cls is not an integer")
            return None
    if not verify:
        return None
    if ext == "json":
        try:
            json.loads(data)
        except ValueError:
            report.errors.append(f"{shard}: {name}: invalid JSON")
    elif ext in IMAGE_EXTENSIONS:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(data)) as image:
                image.load()
        except Exception as exc:  # PIL raises many types for bad data
            report.errors.append(f"{shard}: {name}: cannot decode image: {exc}")
    return None


def inspect_shard(url: str, report: ShardReport, *, verify: bool, num_keys: int) -> ShardReport:
    """Read one shard with webdataset's tar iterator, filling and returning `report`."""
    from webdataset.tariterators import base_plus_ext, tar_file_iterator

    shown = report.url
    try:
        raw = fsspec.open(url, "rb").open()
    except FileNotFoundError:
        report.errors.append(f"{shown}: shard not found")
        return report
    except OSError as exc:
        report.errors.append(f"{shown}: cannot open: {exc}")
        return report
    stream = _HashingReader(raw)
    seen_keys: set[str] = set()
    current_key: str | None = None
    current_exts: set[str] = set()
    last_name = "(start of shard)"
    reading = [last_name]  # the member whose data is being read (set before the read can fail)

    def note_member(name: str) -> bool:
        reading[0] = name
        return True

    def close_sample() -> None:
        if current_key is not None and not current_exts & IMAGE_EXTENSIONS:
            report.errors.append(
                f"{shown}: sample {current_key!r} has no image member ({', '.join(sorted(current_exts))})"
            )

    try:
        for member in tar_file_iterator(
            io.BufferedReader(stream, 1 << 20), skip_meta=None, select_files=note_member
        ):
            name, data = member["fname"], member["data"]
            key, ext = base_plus_ext(name)
            last_name = name
            if key is None:
                report.errors.append(
                    f"{shown}: {name}: member name has no extension (no sample key)"
                )
                continue
            ext = ext.lower()
            if key != current_key:
                close_sample()
                if key in seen_keys:
                    report.errors.append(
                        f"{shown}: {name}: key {key!r} appears again (a sample's members must be adjacent)"
                    )
                seen_keys.add(key)
                current_key, current_exts = key, set()
                report.num_samples += 1
                if len(report.sample_keys) < num_keys:
                    report.sample_keys.append(key)
            elif ext in current_exts:
                report.errors.append(f"{shown}: {name}: duplicate member")
            current_exts.add(ext)
            label = _check_member(shown, name, ext, data, report, verify)
            if label is not None:
                report.class_histogram[label] += 1
        close_sample()
        stream.drain()
    except Exception as exc:
        reason = str(exc).split(" @ ")[0]
        if reading[0] != last_name:
            report.errors.append(f"{shown}: {reading[0]}: unreadable member: {reason}")
        else:
            report.errors.append(f"{shown}: unreadable tar after member {last_name}: {reason}")
    finally:
        raw.close()
    report.num_bytes = stream.num_bytes
    # Sizes and digests are checked on every pass: the bytes were read and hashed anyway.
    if report.expected_bytes and not report.errors:
        if stream.num_bytes != report.expected_bytes:
            report.errors.append(
                f"{shown}: size {stream.num_bytes} bytes, index says {report.expected_bytes}"
            )
        elif report.expected_sha256 not in ("", stream.sha256.hexdigest()):
            report.errors.append(f"{shown}: sha256 differs from the index")
    if (
        report.expected_samples is not None
        and report.num_samples != report.expected_samples
        and not report.errors
    ):
        report.errors.append(
            f"{shown}: {report.num_samples} samples, index says {report.expected_samples}"
        )
    return report


def _inspect_shard_task(task: tuple[str, ShardReport, bool, int]) -> ShardReport:
    url, report, verify, num_keys = task
    return inspect_shard(url, report, verify=verify, num_keys=num_keys)


def inspect_dataset(
    spec: str, *, verify: bool = False, num_keys: int = 5, workers: int = 1
) -> list[DatasetReport]:
    """Read every shard `spec` names once, checking structure, sizes and sha256; `verify` also decodes.

    `workers` > 1 reads shards in that many processes (results are the same, in shard order).

    Raises:
        ConvertError / ShardIndexError: `spec` names nothing readable.
    """
    reports = []
    for name, index, urls in resolve(spec):
        dataset = DatasetReport(
            source=redact_url(name),
            index_url=redact_url(name) if index is not None else None,
            class_names=index.class_names if index is not None else (),
            shards=[],
            verified=verify,
        )
        tasks = []
        for i, url in enumerate(urls):
            if index is not None:
                info = index.shards[i]
                report = ShardReport(info.url, info.num_samples, info.num_bytes, info.sha256)
            else:
                report = ShardReport(redact_url(url), None, None)
            tasks.append((url, report, verify, num_keys))
        if workers > 1 and len(tasks) > 1:
            import webdataset.tariterators  # noqa: F401  (once, before forking)

            with process_pool(workers, preload_pil=verify) as pool:
                dataset.shards = list(pool.map(_inspect_shard_task, tasks))
        else:
            dataset.shards = [_inspect_shard_task(task) for task in tasks]
        for report in dataset.shards:
            dataset.errors.extend(report.errors)
            dataset.class_histogram.update(report.class_histogram)
            dataset.sample_keys.extend(report.sample_keys[: num_keys - len(dataset.sample_keys)])
        reports.append(dataset)
    return reports


def format_report(report: DatasetReport, *, max_shards: int = 20) -> str:
    """The human-readable text of one report."""
    lines = [f"{'index' if report.index_url else 'shards'}: {report.source}"]
    lines.append(
        f"samples: {report.num_samples} in {len(report.shards)} shards, {report.num_bytes / 1e6:.1f} MB"
        + (f", {len(report.class_names)} classes" if report.class_names else "")
    )
    lines.append("shards:")
    width = max((len(s.url) for s in report.shards), default=0)
    for shard in report.shards[:max_shards]:
        status = "ok" if not shard.errors else f"{len(shard.errors)} problem(s)"
        lines.append(
            f"  {shard.url:<{width}}  {shard.num_samples:>8} samples  {shard.num_bytes / 1e6:8.1f} MB  {status}"
        )
    if len(report.shards) > max_shards:
        lines.append(f"  ... {len(report.shards) - max_shards} more (--json lists all)")
    if report.class_histogram:
        lines.append("classes:")
        for label, count in sorted(report.class_histogram.items()):
            name = report.class_names[label] if 0 <= label < len(report.class_names) else ""
            lines.append(f"  {label:>5} {name:<20} {count}")
    lines.append(f"sample keys: {', '.join(report.sample_keys)}")
    if report.errors:
        lines.append(f"PROBLEMS ({len(report.errors)}):")
        lines.extend(f"  {e}" for e in report.errors)
    else:
        checked = "structure, sizes and sha256" if report.index_url else "structure"
        checked += (
            ", every sample decoded" if report.verified else " (--verify also decodes every sample)"
        )
        lines.append(f"OK: {checked}")
    return "\n".join(lines)
