"""`hpctrain eval RUN --data qa.jsonl --prompt-field prompt --response-field response`.

A held-out file of questions, answered by a checkpoint's model and scored as the training's
evaluations score `eval.generate` (`hpctrain.tasks.answers`), without converting it first:
each JSONL record becomes a document as `hpctrain convert` would make it
(`hpctrain.convert.instructions`: `--prompt-field`/`--response-field`, or `--messages-field`
with the tokenizer's chat template), its prompt is answered greedily and the answer compared
with the reference. Each rank answers its share; the counts are summed in one all-reduce and
rank 0 writes the summary record (`RUN_DIR/eval/step-<N>.<file>-<hash>.json`, or `--out`)
and, next to it, one line per record (`*.predictions.jsonl`: key, prompt, reference, answer,
match, token_f1), in file order.

A record that cannot be read (not JSON, a missing field, an empty prompt) fails the command
naming the file and line, or is counted (`records_skipped`) and logged under
`data.on_error=skip`.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import fsspec
import torch.distributed as dist

from hpctrain.config import Config
from hpctrain.convert.instructions import RecordError, jsonl_document, record_format
from hpctrain.data.documents import Document
from hpctrain.data.index import redact_url
from hpctrain.data.tokenizer import Tokenizer
from hpctrain.distributed import all_reduce_tensors
from hpctrain.errors import DataError, UsageError
from hpctrain.files import write_atomic
from hpctrain.inference.evaluate import check_record_path, data_name, log_to_trackers, record_name
from hpctrain.inference.session import inference_session
from hpctrain.tasks.answers import (
    Answer,
    Example,
    Share,
    answer_examples,
    answer_metrics,
    answer_sums,
    example_of,
)

log = logging.getLogger("hpctrain")


class AnswersDataError(DataError, ValueError):
    """A question file that cannot be read, or a record of it (names the file and line)."""


def read_examples(
    path: str, fields: dict[str, str], tokenizer: Tokenizer, *, skip: bool
) -> tuple[list[Example], int]:
    """(the examples of the JSONL file `path`, records skipped), see the module.

    Args:
        fields: `prompt_field`, `response_field` or `messages_field` (as `convert` takes them).
        skip: count a bad record instead of failing.

    Raises:
        AnswersDataError: the file cannot be opened, or a bad record without `skip`.
    """
    try:
        fmt = record_format(
            fields.get("prompt_field", ""),
            fields.get("response_field", ""),
            fields.get("messages_field", ""),
            tokenizer.name,
        )
    except ValueError as exc:
        raise UsageError(f"--data {path}: {exc}") from None
    assert fmt is not None  # fields name a format (`hpctrain eval` checks)
    where = redact_url(path)
    name = Path(path.split("?", 1)[0]).name
    specials = set(tokenizer.specials.values())
    examples: list[Example] = []
    skipped = 0
    try:
        with fsspec.open(path, "rb") as f:
            lines = f.read().splitlines()
    except (OSError, ValueError) as exc:
        raise AnswersDataError(f"--data {where}: cannot be read ({exc})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            ids, mask = jsonl_document(line, fmt, tokenizer)
            example = example_of(
                Document(f"{name}:{number}", ids, mask), tokenizer.eod_id, specials
            )
            if example is None:
                raise RecordError("nothing to answer: the prompt is empty")
        except RecordError as exc:
            if not skip:
                raise AnswersDataError(
                    f"{where}:{number}: {exc} (data.on_error=skip counts and skips it)"
                ) from None
            skipped += 1
            log.warning("%s:%d: %s: skipped", where, number, exc)
            continue
        examples.append(example)
    if not examples:
        raise AnswersDataError(f"--data {where}: holds no record to answer")
    return examples, skipped


def prediction_file(record: Path) -> Path:
    """The predictions beside a summary record: `step-4.qa-1a2b3c4d.json` ->
    `step-4.qa-1a2b3c4d.predictions.jsonl`."""
    return record.with_name(record.name.removesuffix(".json") + ".predictions.jsonl")


def prediction_line(answer: Answer) -> dict[str, Any]:
    return {
        "key": answer.example.key,
        "prompt": answer.prompt,
        "reference": answer.reference,
        "answer": answer.answer,
        "match": answer.exact_match,
        "token_f1": answer.token_f1,
    }


def run_answers(
    cfg: Config,
    *,
    data: str,
    fields: dict[str, str],
    checkpoint: str = "latest",
    out: str = "",
    tokenizer_spec: str = "",
) -> int:
    """`hpctrain eval --data FILE.jsonl` in this process, as one rank of the job (see the
    module); returns the exit code.

    Raises:
        UsageError: `out` is a folder, or the run's task answers no prompts.
        AnswersDataError: see `read_examples`.
    """
    check_record_path(out)
    # the tokenizer the checkpoint records, or `--tokenizer` where it has moved
    session = inference_session(
        cfg,
        checkpoint,
        "",
        key="",
        predict=False,
        tokenizer_spec=tokenizer_spec,
        text=True,
        label=data,
    )
    with session as run:
        text_tokenizer = getattr(run.task, "text_tokenizer", None)
        if not callable(getattr(run.task, "answer_sums", None)) or text_tokenizer is None:
            raise UsageError(f"--data {data}: task {cfg.task} answers no prompts (causal_lm does)")
        tokenizer = text_tokenizer()
        examples, skipped = read_examples(data, fields, tokenizer, skip=cfg.data.on_error == "skip")
        env = run.env
        share = Share(rank=env.rank, size=env.world_size, lockstep=env.is_distributed)
        run.model.eval()
        with run.precision.autocast():
            answers = answer_examples(
                run.model,
                examples,
                tokenizer,
                max_new_tokens=cfg.eval.max_new_tokens,
                batch_size=cfg.eval.generate_batch_size or cfg.data.batch_size,
                window=cfg.data.seq_len,
                normalize_with=cfg.eval.normalize,
                share=share,
            )
        totals = all_reduce_tensors(answer_sums(answers, run.device))
        lines = [prediction_line(a) for a in answers]
        if env.is_distributed:  # every rank's lines to rank 0, to write in file order
            gathered: list[Any] = [None] * env.world_size if env.is_main else []
            dist.gather_object(lines, gathered if env.is_main else None, dst=0)
            lines = [line for part in gathered for line in part] if env.is_main else []
        if not env.is_main:
            return 0
        order = {example.key: n for n, example in enumerate(examples)}
        lines.sort(key=lambda line: order[line["key"]])
        metrics = answer_metrics({k: v.cpu() for k, v in totals.items()})
        default = Path(cfg.run_dir) / "eval" / f"step-{run.step}.{record_name(data)}.json"
        path = Path(out) if out else default
        predictions = prediction_file(path)
        record: dict[str, Any] = {
            "kind": "eval",
            "step": run.step,
            "checkpoint": run.checkpoint,
            "weights": run.weights,
            **({"lora_base": run.lora_base} if run.lora_base else {}),
            "data": redact_url(data),
            "world_size": env.world_size,
            **{f"val_{name}": value for name, value in metrics.items()},
            "records_skipped": skipped,
            "predictions": str(predictions),
            "record": str(path),
        }
        text = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
        write_atomic(predictions, text.encode(), what="the predictions")
        write_atomic(path, (json.dumps(record, indent=1) + "\n").encode(), what="the record")
        print(json.dumps(record), flush=True)
        log_to_trackers(cfg, record, data_name(data), env.world_size)
        return 0
