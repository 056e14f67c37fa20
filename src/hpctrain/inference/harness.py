"""`hpctrain eval RUN --harness TASK[,TASK...]`: EleutherAI's lm-evaluation-harness, offline.

The harness (the `eval` extra: `pip install 'hpctrain[eval]'`) scores a model through three
requests (`lm_eval.api.model.LM`): the log-likelihood of a continuation after a context
(multiple choice), the rolling log-likelihood of a text (perplexity), and greedy generation
until a stop text. `HpctrainLM` answers them with the run's GPT as the harness's own `hf`
model type answers them for the exported Hugging Face folder: it subclasses the harness's
`TemplateLM`, so contexts and continuations are split into tokens by the harness's own rule,
truncated on the left to the model's window (`data.seq_len`, or `--max-length`), and
generations are cut at the first stop text; so the two give the same scores
(`tests/inference/test_harness.py` checks it on a multiple-choice and a generation task).
Text is encoded as the run's training data was: the run's tokenizer, no BOS added.

Compute nodes have no internet: the harness runs with `HF_DATASETS_OFFLINE=1` and
`HF_HUB_OFFLINE=1`, and its tasks and their data are loaded before the model: a task whose
data is not on this machine fails in one line naming the offline ways, a folder of the
harness's task YAML files (`--harness-include DIR`) whose `dataset_path` is `json`, `csv`,
`parquet`, `arrow` or `text` with `dataset_kwargs: {data_files: ...}` naming local files, or
the Hugging Face cache filled beforehand on a login node.

The scores go to `RUN_DIR/eval/harness-<tasks>-step-<N>.json` (or `--out`) and, as
`harness.<task>/<metric>`, to the run's trackers, with the harness's standard errors (its
default `bootstrap_iters`, as its command line computes them) and the record of what decides
the scores: `max_length` (the window) and `lm_eval_command`, the `lm_eval` command line that
gives the same scores on the run's `export --format hf` folder (which keeps the model's
context, `max_position_embeddings`: lm-eval's default window, not `data.seq_len`). One process
(CPU or one GPU), in the run's precision on GPUs.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
import shlex
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hpctrain.config import Config
from hpctrain.data.tokenizer import UNKNOWN, Tokenizer
from hpctrain.errors import UsageError, install_hint
from hpctrain.files import write_atomic
from hpctrain.inference.generate import generation_precision, load_gpt, run_tokenizer
from hpctrain.models.decoding import decode
from hpctrain.models.lora_base import describe_configured_base

log = logging.getLogger("hpctrain")

# lm-eval's own default (its command line's too): its standard errors, as it prints them
# (closed forms for means such as acc and exact_match, bootstraps for the others)
BOOTSTRAP_ITERS = 100_000
DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
OFFLINE_HINT = (
    "compute nodes have no internet: copy the data to local files named in a task YAML "
    "(dataset_path: json|parquet|csv, dataset_kwargs: {data_files: ...}) in a folder given as "
    "--harness-include DIR, or load the task once on a login node so that it is in the "
    "Hugging Face cache (HF_HOME on a shared disk) (docs/inference.md)"
)


def import_harness() -> Any:
    """The `lm_eval` package, offline.

    Raises:
        UsageError: it is not installed (naming the extra).
    """
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import lm_eval
        import lm_eval.tasks
    except ImportError:
        raise UsageError("--harness needs lm-evaluation-harness: " + install_hint("eval")) from None
    return lm_eval


def task_names(spec: str) -> list[str]:
    """`TASK[,TASK...]` as a list.

    Raises:
        UsageError: no task named.
    """
    names = [name.strip() for name in spec.split(",") if name.strip()]
    if not names:
        raise UsageError("--harness: name at least one task (TASK[,TASK...])")
    return names


@functools.lru_cache(maxsize=4)
def task_manager(include: str = "") -> Any:
    """The harness's task index with the tasks of `include` (a folder; "" for none). Kept
    per process: building it reads every task YAML the harness ships (seconds)."""
    import_harness()
    from lm_eval.tasks import TaskManager

    return TaskManager(include_path=include or None)


def check_offline(manager: Any, names: list[str], include: str) -> None:
    """Load the tasks and their data before any model: a task the harness does not know, or
    whose data is neither in local files nor in this machine's Hugging Face cache, fails here
    in one line naming the offline ways. (`simple_evaluate` loads them again: from local
    files or the memory-mapped cache, a small cost next to the evaluation.)

    Raises:
        UsageError: one line naming the task and the offline ways.
    """
    for name in names:
        if name not in manager.all_tasks:
            where = f" or of --harness-include {include}" if include else ""
            raise UsageError(f"--harness {name}: not a task of lm-evaluation-harness{where}")
    try:
        manager.load(names)
    except (ConnectionError, OSError) as exc:
        raise UsageError(
            f"--harness {','.join(names)}: a task's data is not on this machine ({exc}); "
            + OFFLINE_HINT
        ) from None


def harness_lm(
    model: nn.Module, tokenizer: Tokenizer, *, max_length: int, batch_size: int, precision: Any
) -> Any:
    """An `lm_eval` model answering with `model` (see the module)."""
    from lm_eval.api.model import TemplateLM
    from lm_eval.models.utils import (
        handle_stop_sequences,
        normalize_gen_kwargs,
        postprocess_generated_text,
    )
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    device = next(model.parameters()).device
    eod = tokenizer.eod_id
    eod_text = next((text for text, i in tokenizer.specials.items() if i == eod), None)

    def stop_text(until: list[str]) -> Any:
        """True once a row's text holds a stop text (the row stops; its text is cut there)."""
        return lambda ids: any(stop in tokenizer.decode(ids, unknown=UNKNOWN) for stop in until)

    class HpctrainLM(TemplateLM):  # type: ignore[misc]
        @property
        def eot_token_id(self) -> int:
            return eod

        @property
        def max_length(self) -> int:
            return max_length

        def tok_encode(
            self, string: str, add_special_tokens: bool | None = None, **kwargs: Any
        ) -> list[int]:
            return tokenizer.encode(string)

        @torch.no_grad()
        def _loglikelihood_tokens(
            self, requests: list[Any], disable_tqdm: bool = False, **kwargs: Any
        ) -> list[tuple[float, bool]]:
            results: list[tuple[float, bool]] = []
            for start in range(0, len(requests), batch_size):
                chunk = requests[start : start + batch_size]
                # the last max_length + 1 tokens, less the last: the model's input
                inputs = [(ctx + cont)[-(max_length + 1) :][:-1] for _, ctx, cont in chunk]
                width = max(len(row) for row in inputs)
                tokens = torch.zeros(len(chunk), width, dtype=torch.long, device=device)
                for i, row in enumerate(inputs):  # right padding: earlier positions see none
                    tokens[i, : len(row)] = torch.tensor(row, device=device)
                with precision.autocast():
                    logits = model(tokens).float()
                scores = F.log_softmax(logits, dim=-1)
                for i, (_, _, cont) in enumerate(chunk):
                    end = len(inputs[i])
                    rows = scores[i, end - len(cont) : end]
                    target = torch.tensor(cont, device=device)
                    greedy = bool((rows.argmax(dim=-1) == target).all())
                    results.append((float(rows.gather(1, target[:, None]).sum()), greedy))
            return results

        def loglikelihood_rolling(
            self, requests: list[Any], disable_tqdm: bool = False
        ) -> list[float]:
            totals = []
            for (text,) in [request.args for request in requests]:
                windows = [
                    (None, *make_disjoint_window(window))
                    for window in get_rolling_token_windows(
                        token_list=self.tok_encode(text),
                        prefix_token=self.prefix_token_id,
                        max_seq_len=max_length,
                        context_len=1,
                    )
                ]
                totals.append(sum(score for score, _ in self._loglikelihood_tokens(windows)))
            return totals

        def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
            answers: list[str] = [""] * len(requests)
            groups: dict[str, list[int]] = {}
            for n, request in enumerate(requests):
                groups.setdefault(json.dumps(request.args[1], sort_keys=True), []).append(n)
            for members in groups.values():
                kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), 256)
                until = handle_stop_sequences(kwargs.pop("until", None), eos=eod_text)
                new_tokens = int(kwargs.pop("max_gen_toks"))
                temperature = float(kwargs.get("temperature") or 0.0)
                if not kwargs.get("do_sample"):
                    temperature = 0.0
                keep = max(1, max_length - new_tokens)
                for start in range(0, len(members), batch_size):
                    chunk = members[start : start + batch_size]
                    prompts = [self.tok_encode(requests[n].args[0])[-keep:] or [eod] for n in chunk]
                    with precision.autocast():
                        continued = decode(
                            model,
                            prompts,
                            max_new_tokens=new_tokens,
                            stop_ids=(eod,),
                            window=max_length,
                            temperature=temperature,
                            top_k=int(kwargs.get("top_k") or 0),
                            stop_when=stop_text(until),
                        )
                    for n, ids in zip(chunk, continued, strict=True):
                        text = tokenizer.decode([i for i in ids if i != eod], unknown=UNKNOWN)
                        answers[n] = postprocess_generated_text(text, until, None)
            return answers

    return HpctrainLM()


def lora_base_entry(tree: dict[str, Any], lora_base: str) -> dict[str, str]:
    """{"lora_base": ...} for a LoRA run's record (which base its adapters were merged into)."""
    held = describe_configured_base(tree, lora_base)
    return {"lora_base": held} if held else {}


def harness_record_path(run_dir: str, names: list[str], step: int) -> Path:
    """`RUN_DIR/eval/harness-<tasks>-step-<N>.json` (the names made file-name safe)."""
    joined = re.sub(r"[^A-Za-z0-9_.,+-]", "_", ",".join(names))
    return Path(run_dir) / "eval" / f"harness-{joined}-step-{step}.json"


def run_harness(
    cfg: Config,
    *,
    tasks: str,
    checkpoint: str = "latest",
    include: str = "",
    num_fewshot: int | None = None,
    limit: float | None = None,
    max_length: int = 0,
    batch_size: int = 0,
    out: str = "",
    tokenizer_spec: str = "",
) -> int:
    """`hpctrain eval --harness` (see the module); returns the exit code. `tokenizer_spec`:
    `--tokenizer`, where the run's has moved (checked by sha256, as `generate` checks it).

    Raises:
        UsageError: the harness missing, an unknown task, a task needing the internet, a
            `--harness-include` that is not a folder.
        CheckpointError: no usable checkpoint, or not a causal_lm run's.
    """
    names = task_names(tasks)
    if include and not Path(include).is_dir():
        raise UsageError(f"--harness-include {include}: not a folder of task YAML files")
    lm_eval = import_harness()
    manager = task_manager(include)
    check_offline(manager, names, include)
    which = cfg.checkpoint_root() if checkpoint in ("", "latest", "best") else checkpoint
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, tree, step, recorded = load_gpt(
        which,
        best=checkpoint == "best",
        device=device,
        ema=cfg.train.ema_eval,
        lora_base=cfg.eval.lora_base,
    )
    tokenizer = run_tokenizer(tree, tokenizer_spec, recorded)  # the one the checkpoint records
    window = max_length or cfg.data.seq_len or 2048
    precision = generation_precision(tree, device)
    batch = batch_size or cfg.data.batch_size
    lm = harness_lm(model, tokenizer, max_length=window, batch_size=batch, precision=precision)
    try:
        results = lm_eval.simple_evaluate(
            model=lm,
            tasks=names,
            num_fewshot=num_fewshot,
            limit=limit,
            task_manager=manager,
            bootstrap_iters=BOOTSTRAP_ITERS,
            log_samples=False,
            random_seed=cfg.seed,
            numpy_random_seed=cfg.seed,
            torch_random_seed=cfg.seed,
            fewshot_random_seed=cfg.seed,
        )
    except (ConnectionError, OSError) as exc:  # data the checks above could not see
        raise UsageError(
            f"--harness {tasks}: cannot load a task's data ({exc}); {OFFLINE_HINT}"
        ) from None
    assert results is not None  # rank 0 of one process
    record = {
        "kind": "harness",
        "step": step,
        "checkpoint": str(which),
        "weights": "ema" if cfg.train.ema_eval else "model",
        **lora_base_entry(tree, cfg.eval.lora_base),
        "tasks": names,
        "num_fewshot": num_fewshot,
        "limit": limit,
        "max_length": window,
        "bootstrap_iters": BOOTSTRAP_ITERS,
        "lm_eval_command": lm_eval_command(
            names,
            include=include,
            num_fewshot=num_fewshot,
            limit=limit,
            max_length=window,
            seed=cfg.seed,
            dtype=DTYPE_NAMES.get(precision.name, "float32"),
            batch_size=batch,
            device=device.type,
        ),
        "results": results["results"],
        "versions": results.get("versions", {}),
        "n_samples": results.get("n-samples", {}),
    }
    path = Path(out) if out else harness_record_path(cfg.run_dir, names, step)
    record["record"] = str(path)
    write_atomic(
        path, (json.dumps(record, indent=1, default=str) + "\n").encode(), what="the record"
    )
    log.info(
        "the same scores from lm-evaluation-harness on this checkpoint's export (hpctrain "
        "export RUN OUT --format hf; lm-eval defaults max_length to the model's context, "
        "not data.seq_len): %s",
        record["lm_eval_command"],
    )
    print(json.dumps(record, default=str), flush=True)
    log_harness(cfg, record)
    return 0


def lm_eval_command(
    names: list[str],
    *,
    include: str,
    num_fewshot: int | None,
    limit: float | None,
    max_length: int,
    seed: int,
    dtype: str,
    batch_size: int,
    device: str,
) -> str:
    """The `lm_eval` command line that scores the export (`OUT`: `hpctrain export RUN OUT
    --format hf`) as this evaluation scored the run: the same window (`max_length`: the
    export keeps the model's context, which lm-eval would take instead), tasks, shots, limit,
    seeds, precision and batch size."""
    model_args = f"pretrained=OUT,max_length={max_length},dtype={dtype}"
    words = ["lm_eval", "--model", "hf", "--model_args", model_args, "--tasks", ",".join(names)]
    if include:
        words += ["--include_path", str(Path(include).resolve())]
    if num_fewshot is not None:
        words += ["--num_fewshot", str(num_fewshot)]
    if limit is not None:
        words += ["--limit", f"{limit:g}"]
    words += ["--seed", str(seed), "--batch_size", str(batch_size), "--device", device]
    return shlex.join(words)


def harness_scores(record: dict[str, Any]) -> dict[str, float]:
    """`harness.<task>/<metric>` of each numeric score (the harness's `metric,filter` keys,
    `,none` dropped)."""
    scores = {}
    for task, metrics in record["results"].items():
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                scores[f"harness.{task}/{key.removesuffix(',none')}"] = float(value)
    return scores


def log_harness(cfg: Config, record: dict[str, Any]) -> None:
    """Send the scores to the run's tracked run (W&B/MLflow), kind `harness`."""
    from hpctrain.observe.trackers import start_trackers

    trackers = start_trackers(cfg, 1, resumed=True)
    if trackers is None:
        return
    status = "failed"
    try:
        trackers.log({"kind": "harness", "step": record["step"], **harness_scores(record)})
        status = "finished"
    finally:
        trackers.close(status)
