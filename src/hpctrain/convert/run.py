"""`convert(options)`: the sample pipeline: list, plan, write shards (in parallel), then the
index, last (the order of effects on DEST is in `destination.py`); a text source or a token
index goes to the token pipeline (`text.py`) instead.
"""

from __future__ import annotations

import posixpath
import tempfile
from concurrent.futures import FIRST_EXCEPTION, Future, wait
from dataclasses import dataclass

from hpctrain.convert import destination, text
from hpctrain.convert.destination import SKIPPED_NAME, Layout
from hpctrain.convert.errors import ConvertError
from hpctrain.convert.layout import assign_shards, order_samples, plan_fingerprint, split_train_val
from hpctrain.convert.options import (
    ConvertOptions,
    ConvertResult,
    check_options_apply,
    command_line,
    list_options,
    settings,
    validate,
)
from hpctrain.convert.processes import process_pool
from hpctrain.convert.progress import Progress
from hpctrain.convert.sources import detect_kind, list_source
from hpctrain.convert.sources.base import SampleRef, Source
from hpctrain.convert.writer import (
    EncodeOptions,
    ShardResult,
    ShardTask,
    scan_committed_shard,
    write_shard,
)
from hpctrain.data.index import ShardIndex, ShardInfo, redact_url
from hpctrain.files import no_space


def convert(options: ConvertOptions) -> ConvertResult:
    """Convert `options.src` into shards and index(es) under `options.dest`.

    The steps: validate the options, list the source and plan the shards, prepare DEST (the
    state file), write the shards, then commit (`skipped.txt`, the indexes, state file removed).

    Raises:
        ConvertError: among others, a write that found no room (a full disk or quota, in
            DEST or in the temporary spool): one line naming the path and "No space left on
            device"; the shards written so far stay for `--resume`.
    """
    try:
        return _convert(options)
    except OSError as exc:
        if not no_space(exc):
            raise
        where = exc.filename or redact_url(options.dest)
        raise ConvertError(f"{where}: cannot write: {exc.strerror}") from None


def _convert(options: ConvertOptions) -> ConvertResult:
    validate(options)
    destination.check_apart(options.src, options.dest)
    layout = destination.split_layout(options)
    index_urls = destination.index_urls_of(layout)
    done = destination.finished(options, layout)
    if done is not None:
        return ConvertResult(done, index_urls, [], sum(len(i.shards) for i in done.values()))
    with tempfile.TemporaryDirectory(prefix="hpctrain-convert-") as spool_dir:
        if text.is_text_conversion(options):
            return text.convert_text(options, spool_dir, layout)
        plan = plan_samples(options, spool_dir, layout)
        shard_urls = {split: [t.url for t in tasks] for split, tasks in plan.tasks.items()}
        destination.prepare(options, layout, shard_urls, plan.fingerprint)
        results, num_resumed = _write_shards(options, plan)
    indexes, skipped = _commit(options, plan, results)
    return ConvertResult(indexes, index_urls, skipped, num_resumed)


@dataclass(frozen=True)
class SamplePlan:
    """What a conversion will write: the listed source, each split's shard tasks, where."""

    source: Source
    settings: dict[str, object]
    layout: Layout
    tasks: dict[str, list[ShardTask]]
    fingerprint: str


def plan_samples(
    options: ConvertOptions, spool_dir: str, layout: Layout, source: Source | None = None
) -> SamplePlan:
    """List the source, split it, order it and cut it into shards (no output written yet).

    `source`: listed already (the parts of an Arrow source, `hpctrain.convert.parts`).
    """
    if source is None:
        kind = source_kind(options)
        check_options_apply(options, kind)
        source = list_source(options.src, kind, list_options(options, spool_dir))
    if options.val_fraction > 0:
        train, val = split_train_val(source.samples, options.val_fraction, options.seed)
        if not val or not train:
            raise ConvertError(
                f"--val-fraction {options.val_fraction}: leaves an empty split for {len(source.samples)} samples"
            )
        by_split: dict[str, list[SampleRef]] = {"train": train, "val": val}
    else:
        by_split = {"": list(source.samples)}
    plans = {
        split: assign_shards(
            order_samples(
                samples, shuffle=options.shuffle, seed=options.seed, split=split or "all"
            ),
            samples_per_shard=options.samples_per_shard,
            shard_size=options.shard_size,
        )
        for split, samples in by_split.items()
    }
    output_settings = settings(options, source.kind)
    encode = EncodeOptions(options.max_side, options.quality)
    tasks = {
        split: [
            ShardTask(
                destination.shard_url(layout, split, i),
                tuple(samples),
                encode,
                options.on_error,
            )
            for i, samples in enumerate(plan)
        ]
        for split, plan in plans.items()
    }
    return SamplePlan(
        source, output_settings, layout, tasks, plan_fingerprint(plans, output_settings)
    )


def source_kind(options: ConvertOptions) -> str:
    return detect_kind(options.src) if options.source_kind == "auto" else options.source_kind


def _write_shards(options: ConvertOptions, plan: SamplePlan) -> tuple[dict[str, ShardResult], int]:
    all_tasks = [task for split in plan.tasks for task in plan.tasks[split]]
    return write_tasks(options, all_tasks, options.resume)


def write_tasks(
    options: ConvertOptions, all_tasks: list[ShardTask], keep: bool
) -> tuple[dict[str, ShardResult], int]:
    """Write every shard of `all_tasks` (`keep`: those committed already are kept, as under
    `--resume`); the results and how many were kept."""
    results: dict[str, ShardResult] = {}
    todo = []
    for task in all_tasks:
        if keep and destination.exists(task.url):
            results[task.url] = scan_committed_shard(task)
        else:
            todo.append(task)
    num_resumed = len(results)
    progress = Progress(sum(len(t.samples) for t in all_tasks), options.progress)
    progress.update(sum(len(t.samples) for t in all_tasks if t.url in results))
    try:
        results.update(_run_tasks(todo, options.workers, progress))
    finally:
        progress.close()
    return results, num_resumed


def _commit(
    options: ConvertOptions, plan: SamplePlan, results: dict[str, ShardResult]
) -> tuple[dict[str, ShardIndex], list[tuple[str, str]]]:
    """The index of each split, committed with `skipped.txt` (`destination.commit`)."""
    urls = {split: [t.url for t in tasks] for split, tasks in plan.tasks.items()}
    indexes, skipped = sample_indexes(
        options, plan.layout, urls, results, plan.settings, plan.source.class_names
    )
    shown = [(redact_url(url), reason) for url, reason in skipped]
    destination.commit(options, plan.layout, indexes, shown)
    return indexes, skipped


def sample_indexes(
    options: ConvertOptions,
    layout: Layout,
    urls: dict[str, list[str]],
    results: dict[str, ShardResult],
    output_settings: dict[str, object],
    class_names: tuple[str, ...],
) -> tuple[dict[str, ShardIndex], list[tuple[str, str]]]:
    """The index of each split (its shards `urls`, in order; those without samples left out)
    and the skipped samples, in plan order."""
    skipped = [item for split in urls for url in urls[split] for item in results[url].skipped]
    command = command_line(options)
    indexes = {}
    for split, split_urls in urls.items():
        shards = tuple(
            ShardInfo(
                url=posixpath.basename(r.url),
                num_samples=r.num_samples,
                num_bytes=r.num_bytes,
                sha256=r.sha256,
            )
            for r in (results[url] for url in split_urls)
            if r.num_samples > 0
        )
        extra = {
            **output_settings,
            "split": split or None,
            "num_skipped": sum(len(results[url].skipped) for url in split_urls),
        }
        indexes[split] = ShardIndex(
            shards=shards,
            base_url=layout[split][0],
            class_names=class_names,
            command=command,
            extra=extra,
        )
    return indexes, skipped


def _run_tasks(tasks: list[ShardTask], workers: int, progress: Progress) -> dict[str, ShardResult]:
    if workers == 1 or len(tasks) <= 1:
        return {task.url: write_shard(task, on_sample=progress.update) for task in tasks}
    results: dict[str, ShardResult] = {}
    with process_pool(workers, preload_pil=any(task.encode.active for task in tasks)) as pool:
        pending: set[Future[ShardResult]] = {pool.submit(write_shard, task) for task in tasks}
        sizes = {task.url: len(task.samples) for task in tasks}
        while pending:
            done, pending = wait(pending, return_when=FIRST_EXCEPTION)
            for future in done:
                if future.exception() is not None:
                    for other in pending:
                        other.cancel()
                    raise future.exception()  # type: ignore[misc]
                result = future.result()
                results[result.url] = result
                progress.update(sizes[result.url])
    return results


def result_summary(result: ConvertResult) -> str:
    """Human-readable lines about a finished conversion."""
    lines = []
    for split, index in result.indexes.items():
        documents = result.num_documents.get(split)
        if index.num_tokens is not None and isinstance(documents, int):
            # token shards pack whole documents into samples: say both, or "1 samples" for
            # 270 records reads as 269 lost
            tokens = index.extra.get("sample_tokens")
            size = f" of up to {tokens:,} tokens" if isinstance(tokens, int) and tokens else ""
            what = (
                f"{documents:,} documents ({index.num_tokens:,} tokens) packed into "
                f"{index.num_samples:,} {'sample' if index.num_samples == 1 else 'samples'}{size}"
            )
        else:
            what = f"{index.num_samples} samples"
        lines.append(
            f"{split or 'shards'}: {what} in {len(index.shards)} shards, "
            f"{index.num_bytes / 1e6:.1f} MB -> {redact_url(result.index_urls[split])}"
        )
    if result.num_resumed_shards:
        lines.append(
            f"resumed: kept {result.num_resumed_shards} shards written by the interrupted run"
        )
    if result.skipped:
        lines.append(f"skipped {len(result.skipped)} samples (listed in {SKIPPED_NAME})")
    return "\n".join(lines)
