"""`hpctrain inspect`: describe shards and, with `verify`, check every byte and decode every sample.

Works on any WebDataset shards, not only ours: an index (or a folder holding one, or the
`train/` + `val/` layout of `convert --val-fraction`), a folder of `.tar` files, a brace
pattern or a single `.tar`. Without an index there is nothing to check sizes and digests
against, but every member is still read and decoded.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import fsspec

from hpctrain.convert.errors import ConvertError
from hpctrain.convert.processes import process_pool
from hpctrain.convert.sources.shards import shard_urls
from hpctrain.data.compact import COMPACT_SUFFIX
from hpctrain.data.index import INDEX_NAME, ShardIndex, read_index, redact_url
from hpctrain.data.node_index import companion_problem, json_of, load_index
from hpctrain.data.stream import ShardStream, pipe_label
from hpctrain.data.tar import iter_samples
from hpctrain.data.tokens import LOSS_MASK_FIELD, TOKEN_FIELDS, decode_loss_mask, decode_tokens
from hpctrain.errors import DataError


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
    num_classes: int = 0  # the index's class names, when it has them: labels must be below
    max_pixels: int | None = None  # --verify: larger images are bombs (None: the loader's default)
    # token shards (`hpctrain.data.tokens`): ids counted always; checked against the index's
    # tokenizer (ids below vocab_size, every sample ending with the EOD id) when it has one
    expected_tokens: int | None = None
    num_tokens: int = 0
    tokenizer: dict[str, Any] | None = None
    # instruction data: every sample's loss mask fits its ids; targets counted
    expected_targets: int | None = None
    num_targets: int = 0


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
    tokenizer: dict[str, Any] | None = None  # a token index's

    @property
    def num_samples(self) -> int:
        return sum(s.num_samples for s in self.shards)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.shards)

    @property
    def num_targets(self) -> int:
        return sum(s.num_targets for s in self.shards)

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
            **(
                {
                    "num_tokens": self.num_tokens,
                    "num_targets": self.num_targets,
                    "tokenizer": self.tokenizer,
                }
                if self.tokenizer
                else {}
            ),
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


class _HashingStream(ShardStream):
    """A shard stream that hashes and counts every byte its reader consumes.

    Skips read the bytes instead of seeking past them: a digest must see every byte.
    """

    def __init__(self, url: str) -> None:
        self.sha256 = hashlib.sha256()
        self.num_bytes = 0
        super().__init__(url)

    def _open_at(self, offset: int) -> None:
        super()._open_at(offset)
        # Read in order, never seek back: the seekable path re-reads a member its read-ahead
        # caught in part (`ShardStream._unread`), which would hash and count it twice.
        self._seekable = False

    def _read_raw(self, n: int) -> bytes:
        # every byte comes from the file through here once, in order (read-ahead included)
        data = super()._read_raw(n)
        self.sha256.update(data)
        self.num_bytes += len(data)
        return data

    def skip(self, n: int) -> int:
        missing = n
        while missing > 0:
            data = self.read_view(min(missing, 1 << 20))
            if not data:
                break
            missing -= len(data)
        return missing

    def drain(self) -> None:
        """Read to the end (the archive's end blocks and record padding count in the digest)."""
        while self.read_view(1 << 20):
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
    if spec.endswith(COMPACT_SUFFIX):  # that form, checked against its JSON (node_index)
        index = load_index(json_of(spec), form="compact")
        return [(spec, index, list(index.shard_urls()))]
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


def inspect_shard(url: str, report: ShardReport, *, verify: bool, num_keys: int) -> ShardReport:
    """Read one shard with the loader's own tar parser, filling and returning `report`.

    The steps: open it, read (and with `verify` decode) every sample, then compare what was
    read with the index (size, sha256, sample count).
    """
    try:
        stream = _HashingStream(url)
    except FileNotFoundError:
        report.errors.append(f"{report.url}: shard not found")
        return report
    except OSError as exc:
        report.errors.append(f"{report.url}: cannot open: {exc}")
        return report
    try:
        _read_samples(stream, report, verify=verify, num_keys=num_keys)
    finally:
        stream.close()
    report.num_bytes = stream.num_bytes
    if not report.errors:
        _compare_with_index(report, stream.sha256.hexdigest())
    return report


def _read_samples(
    stream: _HashingStream, report: ShardReport, *, verify: bool, num_keys: int
) -> None:
    """Every sample of the shard: keys in order and unique, fields decoded, labels in range."""
    shown = report.url
    seen_keys: set[str] = set()
    last_key = "(start of shard)"
    try:
        for _, key, members in iter_samples(stream):
            last_key = key
            if "" in members:
                report.errors.append(
                    f"{shown}: {key}: member name has no extension (no sample key)"
                )
                continue
            if key in seen_keys:
                report.errors.append(
                    f"{shown}: sample {key!r} appears again (a sample's members must be adjacent)"
                )
            seen_keys.add(key)
            report.num_samples += 1
            if len(report.sample_keys) < num_keys:
                report.sample_keys.append(key)
            _check_sample(shown, key, members, report, verify)
        stream.drain()
    except DataError as exc:  # a malformed header, a truncated member, a duplicate member
        reason = str(exc).removeprefix(f"{redact_url(stream.url)}: ")
        report.errors.append(f"{shown}: unreadable tar after sample {last_key}: {reason}")


def _check_sample(
    shown: str, key: str, members: dict[str, bytes], report: ShardReport, verify: bool
) -> None:
    """Decode the fields (`verify`: all of them, with the loader's decoders; else only `cls`)."""
    for name in members:
        if name in TOKEN_FIELDS:
            _check_tokens(shown, key, name, members, report)
    label: Any = None
    if verify:
        from hpctrain.data.decode import SampleError, decode_sample

        try:
            limit = {} if report.max_pixels is None else {"max_pixels": report.max_pixels}
            label = decode_sample(key, members, **limit).get("cls")
        except SampleError as exc:
            report.errors.append(f"{shown}: {exc}")
            return
    elif "cls" in members:
        try:
            label = int(bytes(members["cls"]).strip())
        except ValueError:
            report.errors.append(f"{shown}: {key}.cls: not an integer")
            return
    if label is None:
        return
    if report.num_classes and not 0 <= label < report.num_classes:
        report.errors.append(
            f"{shown}: {key}.cls: label {label} outside the index's {report.num_classes} classes"
        )
    report.class_histogram[label] += 1


def _check_tokens(
    shown: str, key: str, name: str, members: dict[str, bytes], report: ShardReport
) -> None:
    """Count a token member's ids and its loss mask's targets; with the index's tokenizer,
    check their range and the EOD."""
    try:
        ids = decode_tokens(members[name], name)
    except ValueError as exc:
        report.errors.append(f"{shown}: {key}.{name}: {exc}")
        return
    report.num_tokens += int(ids.size)
    mask = members.get(LOSS_MASK_FIELD)
    if mask is not None:
        try:
            report.num_targets += int(decode_loss_mask(mask, ids.size).sum())
        except ValueError as exc:
            report.errors.append(f"{shown}: {key}.{exc}")
    elif report.expected_targets is not None:
        report.errors.append(f"{shown}: {key}: no {LOSS_MASK_FIELD} beside {name}")
    info = report.tokenizer
    if info is None:
        return
    if ids.size and int(ids.max()) >= info["vocab_size"]:
        report.errors.append(
            f"{shown}: {key}.{name}: id {int(ids.max())} >= the tokenizer's vocab_size "
            f"{info['vocab_size']}"
        )
    elif not ids.size or int(ids[-1]) != info["eod_id"]:
        report.errors.append(
            f"{shown}: {key}.{name}: does not end with the end-of-document id {info['eod_id']}"
        )


def _compare_with_index(report: ShardReport, sha256: str) -> None:
    """Sizes, digests and counts against the index (checked on every pass: the bytes were read
    and hashed anyway)."""
    shown = report.url
    if report.expected_bytes:
        if report.num_bytes != report.expected_bytes:
            report.errors.append(
                f"{shown}: size {report.num_bytes} bytes, index says {report.expected_bytes}"
            )
            return
        if report.expected_sha256 not in ("", sha256):
            report.errors.append(f"{shown}: sha256 differs from the index")
            return
    if report.expected_samples is not None and report.num_samples != report.expected_samples:
        report.errors.append(
            f"{shown}: {report.num_samples} samples, index says {report.expected_samples}"
        )
    if report.expected_tokens is not None and report.num_tokens != report.expected_tokens:
        report.errors.append(
            f"{shown}: {report.num_tokens} token ids, index says {report.expected_tokens}"
        )
    expected = report.expected_targets
    if expected is not None and report.num_targets != expected:
        report.errors.append(
            f"{shown}: {report.num_targets} target tokens in its loss masks, index says {expected}"
        )


def _inspect_shard_task(task: tuple[str, ShardReport, bool, int]) -> ShardReport:
    url, report, verify, num_keys = task
    return inspect_shard(url, report, verify=verify, num_keys=num_keys)


def inspect_dataset(
    spec: str,
    *,
    verify: bool = False,
    num_keys: int = 5,
    workers: int = 1,
    max_pixels: int | None = None,
) -> list[DatasetReport]:
    """Read every shard `spec` names once, checking structure, sizes and sha256; `verify` also
    decodes every field with the loader's decoders (`hpctrain.data.decode`).

    `workers` > 1 reads shards in that many processes (results are the same, in shard order).
    `max_pixels`: the decompression-bomb limit of `verify` (None: the loader's default).
    Labels (`cls`) outside the index's class names, when it has them, are problems too.

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
            tokenizer=index.tokenizer if index is not None else None,
        )
        tasks = []
        for i, url in enumerate(urls):
            if index is not None:
                info = index.shards[i]
                report = ShardReport(info.url, info.num_samples, info.num_bytes, info.sha256)
                report.expected_tokens = info.num_tokens
                report.expected_targets = info.num_targets
                report.tokenizer = index.tokenizer
            else:
                report = ShardReport(redact_url(url), None, None)
            report.num_classes = len(dataset.class_names)
            report.max_pixels = max_pixels
            tasks.append((url, report, verify, num_keys))
        if workers > 1 and len(tasks) > 1:
            if verify:
                import hpctrain.data.decode  # noqa: F401  (torch: imported once, before forking)

            with process_pool(workers, preload_pil=verify) as pool:
                dataset.shards = list(pool.map(_inspect_shard_task, tasks))
        else:
            dataset.shards = [_inspect_shard_task(task) for task in tasks]
        if name.endswith(".json"):  # its compact form must say the same (index.compact)
            problem = companion_problem(name)
            dataset.errors.extend([problem] if problem else [])
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
    if report.tokenizer:
        tok = report.tokenizer
        lines.append(
            f"tokens: {report.num_tokens} ({tok['name']}, vocab_size {tok['vocab_size']}, "
            f"eod_id {tok['eod_id']}"
            + (f", sha256 {tok['sha256'][:12]}" if tok["sha256"] else "")
            + ")"
        )
        if report.num_targets:
            share = report.num_targets / max(1, report.num_tokens)
            lines.append(f"targets: {report.num_targets} tokens ({share:.1%}, loss mask)")
    elif report.num_tokens:
        lines.append(f"tokens: {report.num_tokens} (no tokenizer in an index: ids not checked)")
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
