"""A conversion in parts: `hpctrain convert SRC DEST --parts N`, as local processes or a SLURM
job array (`hpctrain.launch.convert_array`), then one merge that writes the index.

The output is the one-process conversion's: everything that decides which sample goes where
(the train/validation split, the order, the cut into shards) is decided over the whole source,
by every part alike, before a part writes anything; a part then writes a fixed range of the
planned shards, under the names one process would give them. Stages, each a set of parts that
run in any order and any number at once:

- `tokenize` (text sources, `text.py`): part k tokenizes the chunks whose number is k modulo N
  into its spool (`DEST/.hpctrain-parts/tokenize-0000k/`), the costly step;
- `list` (Arrow/parquet sources): part k encodes its range of the parquet row groups and Arrow
  files into its spool; the rows find their place (key, row number) once all are listed;
- `write`: part k makes the plan (text: from every part's token counts; Arrow: from every
  part's rows; other sources: by listing the source, cheap: names and sizes) and writes its
  range of the shards (a shard already complete under its final name is kept);

then `merge` (one process) checks that every part finished, writes `skipped.txt`, the index of
each split and its compact form (`destination.commit`), reads them back, and removes
`DEST/.hpctrain-parts`. Each part writes a record (`<stage>-0000k.json`) last: a part with a
record is done; `--resume` runs only the others; the merge refuses while one is missing, naming
it. A part writes only its own shards, spool and record: nothing another part wrote is touched.
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import fsspec
import numpy as np

from hpctrain.convert import destination, text
from hpctrain.convert.destination import Layout
from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.options import (
    ConvertOptions,
    ConvertResult,
    check_options_apply,
    command_words,
    list_options,
    validate,
)
from hpctrain.convert.run import plan_samples, sample_indexes, source_kind, write_tasks
from hpctrain.convert.sources.arrow import PartRow, arrow_units, list_arrow_part, place_rows
from hpctrain.convert.sources.base import SampleRef, Source
from hpctrain.convert.tokenize import ChunkResult, assemble, source_chunks, tokenize_chunks
from hpctrain.convert.writer import ShardResult
from hpctrain.data.index import redact_url
from hpctrain.data.node_index import load_index
from hpctrain.files import write_atomic

PARTS_DIR = ".hpctrain-parts"
STAGES = ("tokenize", "list", "write")


def stages_of(options: ConvertOptions) -> tuple[str, ...]:
    """The stages of this conversion (the module doc)."""
    if text.is_text_conversion(options):
        return ("tokenize", "write")
    if source_kind(options) == "arrow":
        return ("list", "write")
    return ("write",)


def part_range(total: int, part: int, parts: int) -> range:
    """Part `part`'s share of `total` items: contiguous, sizes differing by at most one."""
    return range(total * part // parts, total * (part + 1) // parts)


def parts_root(options: ConvertOptions) -> str:
    return destination.join(options.dest, PARTS_DIR)


def record_url(options: ConvertOptions, stage: str, part: int) -> str:
    return destination.join(parts_root(options), f"{stage}-{part:05d}.json")


def spool_folder(options: ConvertOptions, stage: str, part: int) -> str:
    return destination.join(parts_root(options), f"{stage}-{part:05d}")


def parts_fingerprint(options: ConvertOptions, parts: int) -> str:
    """What the parts' records must agree on: the command (options that decide the output)
    and the number of parts."""
    words = command_words(options)
    return "parts:" + hashlib.sha256(json.dumps([words, parts]).encode()).hexdigest()


def check_parts(options: ConvertOptions, parts: int, max_parallel: int = 0) -> None:
    """Refuse what a conversion in parts cannot do, before anything is read or written."""
    if parts < 1:
        raise ConvertOptionError(f"--parts {parts}: must be 1 or more")
    if max_parallel < 0:
        raise ConvertOptionError(f"--max-parallel {max_parallel}: must be 1 or more")
    validate(options)
    if options.dest.startswith("memory://"):
        raise ConvertOptionError(
            "memory:// lives inside one process: a conversion in parts writes from several"
        )
    stages = stages_of(options)
    if stages[0] != "write":
        fs, _ = fsspec.core.url_to_fs(options.dest)
        if "file" not in fs.protocol:  # the spools are memory-mapped by every writing part
            raise ConvertOptionError(
                f"--parts with a {'text' if stages[0] == 'tokenize' else 'Arrow/parquet'} "
                f"source keeps its spool in DEST/{PARTS_DIR}: DEST must be a local or shared "
                f"POSIX folder, not {redact_url(options.dest)}"
            )
    if stages[0] != "tokenize":
        check_options_apply(options, source_kind(options))


# -- before the parts, and the merge after them ----------------------------------------------


def prepare_parts(options: ConvertOptions, parts: int) -> ConvertResult | None:
    """Make DEST ready for the parts (the one-process conversion's checks, the state file);
    the result when `--resume` finds the conversion finished already."""
    destination.check_apart(options.src, options.dest)
    layout = destination.split_layout(options)
    done = destination.finished(options, layout)
    if done is not None:
        return ConvertResult(done, destination.index_urls_of(layout), [], 0)
    if not options.resume:  # records of an earlier conversion (or of one --overwrite replaces)
        _remove_tree(parts_root(options))
    first = {split: [destination.shard_url(layout, split, 0)] for split in layout}
    destination.prepare(options, layout, first, parts_fingerprint(options, parts))
    return None


def missing_parts(options: ConvertOptions, parts: int, stage: str) -> list[int]:
    """The parts of `stage` without a record of this conversion."""
    fingerprint = parts_fingerprint(options, parts)
    return [k for k in range(parts) if _record(options, stage, k, fingerprint) is None]


def merge_parts(options: ConvertOptions, parts: int) -> ConvertResult:
    """Write the index of every split from the parts' records, once all have finished."""
    _check_state(options, parts)
    stages = stages_of(options)
    records = _records(options, parts, "write")
    plans = {r["plan"] for r in records}
    if len(plans) > 1:
        raise ConvertError(
            f"{redact_url(options.dest)}: the parts planned different shards (the source "
            "changed while they ran); convert again with --overwrite"
        )
    layout = destination.split_layout(options)
    entries = _entries(records)
    _check_shards(entries)
    results = {
        e["url"]: ShardResult(
            e["url"], e["num_samples"], e["num_bytes"], e["sha256"], _pairs(e["skipped"])
        )
        for split_entries in entries.values()
        for e in split_entries
    }
    if stages[0] == "tokenize":
        skipped = [
            pair for r in _records(options, parts, "tokenize") for c in r["chunks"]
            for pair in _pairs(c["errors"])
        ]  # fmt: skip
        tp = text.TextPlan(
            {
                split: [
                    text.ShardPlan(e["url"], (), e["num_tokens"], e["num_targets"]) for e in items
                ]
                for split, items in entries.items()
            },
            records[0]["settings"],
            records[0]["plan"],
        )
        info = records[0]["settings"]["tokenizer"]  # recorded: no tokenizer loaded here
        indexes = text.text_indexes(options, tp, results, layout, info, len(skipped))
    else:
        urls = {split: [e["url"] for e in items] for split, items in entries.items()}
        class_names = tuple(records[0]["class_names"])
        indexes, skipped = sample_indexes(
            options, layout, urls, results, records[0]["settings"], class_names
        )
        skipped = [(redact_url(url), reason) for url, reason in skipped]
    destination.commit(options, layout, indexes, skipped)
    index_urls = destination.index_urls_of(layout)
    for split, index in indexes.items():  # read back, in the form a job's ranks read
        again = load_index(index_urls[split], form="compact")
        if (again.num_shards, again.num_samples) != (index.num_shards, index.num_samples):
            raise ConvertError(f"{redact_url(index_urls[split])}: reads back other shards")
    _remove_tree(parts_root(options))
    for folder, _prefix in layout.values():
        destination.remove_stale(folder)  # temporary files of parts killed while writing
    return ConvertResult(indexes, index_urls, skipped, 0)


def _entries(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """Every split's shard entries in order, each planned shard exactly once."""
    counts = records[0]["num_shards"]
    out: dict[str, list[dict[str, Any]]] = {split: [] for split in counts}
    for r in records:
        for e in r["shards"]:
            out[e["split"]].append({**e, "part": r["part"]})
    for split, items in out.items():
        items.sort(key=lambda e: e["number"])
        if [e["number"] for e in items] != list(range(counts[split])):
            raise ConvertError(f"split {split or 'shards'}: the parts' shards do not add up")
    return out


def _check_shards(entries: dict[str, list[dict[str, Any]]]) -> None:
    """Every recorded shard is there with its recorded size (one listing per folder: the
    merge reads no shard, whose bytes were hashed while written)."""
    sizes: dict[tuple[str, str], int] = {}
    for folder in {posixpath.dirname(e["url"]) for items in entries.values() for e in items}:
        fs, path = fsspec.core.url_to_fs(folder)
        listed = fs.ls(path, detail=True) if fs.isdir(path) else []
        sizes.update({(folder, posixpath.basename(x["name"])): int(x["size"] or 0) for x in listed})
    for items in entries.values():
        for e in items:
            if not e["num_samples"]:
                continue  # every sample skipped: no shard, and none in the index
            size = sizes.get((posixpath.dirname(e["url"]), posixpath.basename(e["url"])))
            if size != e["num_bytes"]:
                raise ConvertError(
                    f"{redact_url(e['url'])}: {'missing' if size is None else f'{size} bytes'}, "
                    f"but part {e['part']} wrote {e['num_bytes']}; remove the shard and "
                    f"{PARTS_DIR}/write-{e['part']:05d}.json, then run again with --resume"
                )


# -- one part ---------------------------------------------------------------------------------


def run_part(options: ConvertOptions, parts: int, part: int, stage: str) -> str:
    """Run `stage` of part `part` (an array task or a local process); a line saying what it did."""
    if not 0 <= part < parts:
        raise ConvertOptionError(f"--run-part {part}: not a part of --parts {parts}")
    stages = stages_of(options)
    if stage not in stages:
        raise ConvertOptionError(
            f"--stage {stage}: this conversion's stages are {', '.join(stages)}"
        )
    _check_state(options, parts)
    fingerprint = parts_fingerprint(options, parts)
    if _record(options, stage, part, fingerprint) is not None:
        return f"part {part} of {parts}, {stage}: done already"
    started = time.perf_counter()
    if stage == "tokenize":
        record = _tokenize_part(options, parts, part)
    elif stage == "list":
        record = _list_part(options, parts, part)
    else:
        record = _write_part(options, parts, part, stages)
    record.update(fingerprint=fingerprint, part=part, parts=parts)
    write_atomic(record_url(options, stage, part), json.dumps(record).encode(), durable=True)
    return f"part {part} of {parts}, {stage}: done in {time.perf_counter() - started:.1f} s"


def _own_spool(options: ConvertOptions, stage: str, part: int) -> str:
    """This part's spool folder, emptied of what an earlier try of it left (its own)."""
    folder = spool_folder(options, stage, part)
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder)
    return folder


def _tokenize_part(options: ConvertOptions, parts: int, part: int) -> dict[str, Any]:
    setup = text.text_setup(options)
    job = text.token_job(options, setup, _own_spool(options, "tokenize", part))
    seen = [0]

    def mine() -> Iterator[Any]:
        for chunk in source_chunks(options, setup.index):
            seen[0] = chunk.number + 1
            if chunk.number % parts == part:
                yield chunk

    chunks = []
    for result in tokenize_chunks(mine(), job, options.workers):
        if result.errors and options.on_error == "fail":
            where, reason = result.errors[0]
            raise ConvertError(
                f"{where}: {reason} (use --on-error skip to skip and list such documents)"
            )
        chunks.append(
            {
                "number": result.number,
                "spool": os.path.basename(result.spool),
                "lengths": result.lengths.tolist(),
                "targets": None if result.targets is None else result.targets.tolist(),
                "errors": [list(e) for e in result.errors],
                "digest": result.digest,
            }
        )
    return {"num_chunks": seen[0], "chunks": chunks}


def _text_documents(options: ConvertOptions, parts: int, with_targets: bool) -> Any:
    """The documents of every part's chunks, in source order (`tokenize.assemble`)."""
    records = _records(options, parts, "tokenize")
    total = {r["num_chunks"] for r in records}
    results = []
    for r in records:
        folder = spool_folder(options, "tokenize", r["part"])
        for c in r["chunks"]:
            targets = c["targets"]
            results.append(
                ChunkResult(
                    c["number"],
                    os.path.join(folder, c["spool"]) if c["spool"] else "",
                    np.array(c["lengths"], dtype=np.int64),
                    _pairs(c["errors"]),
                    c["digest"],
                    None if targets is None else np.array(targets, dtype=np.int64),
                )
            )
    results.sort(key=lambda c: c.number)
    if len(total) != 1 or [c.number for c in results] != list(range(total.pop())):
        raise ConvertError(
            f"{redact_url(options.src)}: the parts saw different documents (the source changed "
            "while they ran); convert again with --overwrite"
        )
    return assemble(options, with_targets, results)


def _list_part(options: ConvertOptions, parts: int, part: int) -> dict[str, Any]:
    units = arrow_units(options.src)
    listing = list_options(options, _own_spool(options, "list", part))
    listed = list_arrow_part(options.src, listing, units, part_range(len(units), part, parts))
    rows = [[r.unit, r.row, r.key, _sample_json(r.sample)] for r in listed.rows]
    return {
        "num_units": len(units),
        "unit_rows": {str(u): n for u, n in listed.unit_rows.items()},
        "class_names": list(listed.class_names),
        "columns": listed.columns,
        "rows": rows,
    }


def _arrow_source(options: ConvertOptions, parts: int) -> Source:
    """Every part's rows, in their places in the whole source (`place_rows`)."""
    records = _records(options, parts, "list")
    rows, unit_rows = [], {}
    columns = [r["columns"] for r in records if r["rows"]]
    for r in records:
        unit_rows.update({int(u): n for u, n in r["unit_rows"].items()})
        rows += [PartRow(u, row, key, _sample_of(s)) for u, row, key, s in r["rows"]]
    if any(c != columns[0] for c in columns):
        raise ConvertError(
            f"{redact_url(options.src)}: its files have different columns "
            f"({', '.join(columns[0])} and {', '.join(next(c for c in columns if c != columns[0]))})"
        )
    # a part with no unit (more parts than units) read no schema: its names say nothing
    class_names = tuple(next((r["class_names"] for r in records if r["rows"]), []))
    return Source("arrow", place_rows(options.src, rows, unit_rows), class_names)


def _write_part(
    options: ConvertOptions, parts: int, part: int, stages: tuple[str, ...]
) -> dict[str, Any]:
    layout = destination.split_layout(options)
    with tempfile.TemporaryDirectory(prefix="hpctrain-convert-") as spool_dir:
        if stages[0] == "tokenize":
            return _write_text_part(options, parts, part, layout)
        source = _arrow_source(options, parts) if stages[0] == "list" else None
        plan = plan_samples(options, spool_dir, layout, source)
        flat = [(split, i, t) for split, tasks in plan.tasks.items() for i, t in enumerate(tasks)]
        mine = [flat[i] for i in part_range(len(flat), part, parts)]
        results, _ = write_tasks(options, [t for _, _, t in mine], keep=True)
    shards = [
        {
            "split": split,
            "number": i,
            "url": t.url,
            **_result_json(results[t.url]),
        }
        for split, i, t in mine
    ]
    return {
        "plan": plan.fingerprint,
        "num_shards": {split: len(tasks) for split, tasks in plan.tasks.items()},
        "class_names": list(plan.source.class_names),
        "settings": plan.settings,
        "shards": shards,
    }


def _write_text_part(
    options: ConvertOptions, parts: int, part: int, layout: Layout
) -> dict[str, Any]:
    setup = text.text_setup(options)
    job = text.token_job(options, setup, "")
    docs, _skipped, digests = _text_documents(options, parts, setup.records is not None)
    tp = text.text_plan(options, setup, docs, digests, layout)
    flat = [(split, i, p) for split, plans in tp.plans.items() for i, p in enumerate(plans)]
    reader = text.SpoolReader(docs, job.dtype)
    shards = []
    for split, i, plan in (flat[i] for i in part_range(len(flat), part, parts)):
        result, _kept = text.write_or_keep(plan, reader, setup.field, keep=True)
        shards.append(
            {
                "split": split,
                "number": i,
                "url": plan.url,
                "num_tokens": plan.num_tokens,
                "num_targets": plan.num_targets,
                **_result_json(result),
            }
        )
    return {
        "plan": tp.fingerprint,
        "num_shards": {split: len(plans) for split, plans in tp.plans.items()},
        "settings": tp.settings,
        "shards": shards,
    }


# -- records ----------------------------------------------------------------------------------


def _check_state(options: ConvertOptions, parts: int) -> None:
    """DEST is being converted in `parts` parts with these options (`prepare_parts` ran)."""
    url = destination.state_url_of(options)
    state: dict[str, Any] = {}
    if destination.exists(url):
        fs, path = fsspec.core.url_to_fs(url)
        state = json.loads(fs.cat_file(path))
    if state.get("fingerprint") != parts_fingerprint(options, parts):
        raise ConvertError(
            f"{redact_url(options.dest)}: not being converted in {parts} parts with these "
            "options; start with `hpctrain convert SRC DEST ... --parts N` (or --resume it)"
        )


def _record(options: ConvertOptions, stage: str, part: int, fingerprint: str) -> Any:
    url = record_url(options, stage, part)
    if not destination.exists(url):
        return None
    fs, path = fsspec.core.url_to_fs(url)
    record = json.loads(fs.cat_file(path))
    return record if record.get("fingerprint") == fingerprint else None


def _records(options: ConvertOptions, parts: int, stage: str) -> list[dict[str, Any]]:
    """Every part's record of `stage`; refused, naming them, while some are missing."""
    fingerprint = parts_fingerprint(options, parts)
    records = [_record(options, stage, k, fingerprint) for k in range(parts)]
    missing = [k for k, r in enumerate(records) if r is None]
    if missing:
        shown = ", ".join(str(k) for k in missing[:10]) + (" ..." if len(missing) > 10 else "")
        raise ConvertError(
            f"{redact_url(options.dest)}: part {shown} of {parts} has not finished its {stage} "
            f"stage (no {PARTS_DIR}/{stage}-{missing[0]:05d}.json); run the same command with "
            "--resume to run only the missing parts"
        )
    return records


def _result_json(result: ShardResult) -> dict[str, Any]:
    return {
        "num_samples": result.num_samples,
        "num_bytes": result.num_bytes,
        "sha256": result.sha256,
        "skipped": [list(s) for s in result.skipped],
    }


def _pairs(items: list[list[str]]) -> tuple[tuple[str, str], ...]:
    return tuple((a, b) for a, b in items)


def _sample_json(sample: SampleRef) -> dict[str, Any]:
    data = asdict(sample)
    data.pop("fields")  # Arrow rows have none (they are spooled members)
    return data


def _sample_of(data: dict[str, Any]) -> SampleRef:
    members = tuple((field, offset, size) for field, offset, size in data.pop("members"))
    return SampleRef(**data, members=members)


def _remove_tree(url: str) -> None:
    fs, path = fsspec.core.url_to_fs(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


# -- running the parts as local processes ------------------------------------------------------


@dataclass(frozen=True)
class PartCommand:
    """The command of one part (what an array task runs, or a local process)."""

    stage: str
    part: int
    words: tuple[str, ...]  # after `hpctrain convert`


def part_words(options: ConvertOptions, parts: int) -> list[str]:
    """The options every part and the merge run with (SRC and DEST whole: a part must read
    what the command names; run-only flags: `--workers` per part, no progress bar)."""
    return [
        *command_words(options, redact=False)[2:],
        "--workers",
        str(options.workers),
        "--progress",
        "none",
        "--parts",
        str(parts),
    ]


def run_locally(options: ConvertOptions, parts: int, max_parallel: int = 0) -> ConvertResult:
    """`--parts N` without `--slurm`: each stage's missing parts as local processes (at most
    `max_parallel` at once; 0: all), then the merge, here."""
    check_parts(options, parts, max_parallel)
    done = prepare_parts(options, parts)
    if done is not None:
        return done
    words = part_words(options, parts)
    for stage in stages_of(options):
        todo = missing_parts(options, parts, stage)
        failed = _run_all(
            [[*words, "--run-part", str(k), "--stage", stage] for k in todo], max_parallel
        )
        if failed:
            shown = ", ".join(str(todo[i]) for i in failed)
            raise ConvertError(
                f"{redact_url(options.dest)}: part {shown} of {parts} failed in the {stage} "
                "stage (its message is above); run the same command with --resume to run only "
                "the parts that did not finish"
            )
    return merge_parts(options, parts)


def _run_all(commands: list[list[str]], max_parallel: int) -> list[int]:
    """Run `hpctrain convert <words>` for every command, at most `max_parallel` at once; the
    positions of those that failed."""
    limit = max_parallel or len(commands) or 1
    running: dict[int, subprocess.Popen[bytes]] = {}
    failed = []
    queue = list(enumerate(commands))
    while queue or running:
        while queue and len(running) < limit:
            i, words = queue.pop(0)
            running[i] = subprocess.Popen([sys.executable, "-m", "hpctrain", "convert", *words])
        for i, proc in list(running.items()):
            if proc.poll() is not None:
                del running[i]
                if proc.returncode:
                    failed.append(i)
        time.sleep(0.05)
    return sorted(failed)
