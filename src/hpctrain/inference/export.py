"""Export a training checkpoint as a consolidated, weights-only state dict.

A DCP checkpoint holds the model sharded (FSDP2) or replicated (DDP) across per-rank files,
next to the optimizer, scheduler, loader and RNG states. `export_weights` reads only the
model's entries (`hpctrain.checkpoint.weights`), in one process, and
writes them with `torch.save` so that `torch.load(path, weights_only=True)` gives a state dict
for `model.load_state_dict` of the plain, unwrapped model, or with the `safetensors` library
(`format="safetensors"`), which any tool loads without hpctrain or pickle.

With `ema=None` (the default) the weights are those the training evaluated with, as for every
verb that reads weights (eval, predict, generate): the EMA's when the run's `train.ema_eval`
is true, else the trained ones. With `ema=True` (`--ema`), the parameters are those of the EMA (`train.ema_decay`, stored as
`ema.<name>` beside `app.model.<name>`, see `hpctrain.train.ema`) and the buffers (BatchNorm
running statistics) those of the model.

For a task with a `model_card` hook (`hpctrain.tasks.task`) the export also writes
`<out>.json` (the weights' file name with `.json` added: `model.safetensors.json`, so two
exports into one folder keep their own cards; an `out` ending in `.json` is refused, it could
be another export's card): what the task says rebuilds the model, with the step and format.
The built-in image classification task's card holds the model name, number and names of the
classes (the checkpoint's), image size, the normalization and how to rebuild the model,
checked against the weights (every name and shape) before it is written; causal_lm's holds
the GPT's shape (`GPTConfig`), the sequence length and how to rebuild the model.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.weights import locate_checkpoint
from hpctrain.errors import UsageError
from hpctrain.files import write_atomic
from hpctrain.models.lora_base import read_weights  # a LoRA run: merged into its base
from hpctrain.tasks.task import DEFAULT_TASK
from hpctrain.tasks.task import model_card as task_model_card

FORMATS = ("pt", "safetensors")


@dataclass(frozen=True)
class ExportResult:
    """What `export_weights` wrote."""

    source: str  # the step-<N> folder read
    step: int
    num_tensors: int
    num_elements: int
    out: Path
    model_card: Path | None = None  # the JSON that rebuilds a built-in model, if written
    ema: bool = False  # the parameters are the EMA's


def format_of(out: str | Path, fmt: str | None) -> str:
    """The export format: `fmt` when given, else from the file name (`.safetensors`, else pt)."""
    if fmt is None:
        return "safetensors" if str(out).endswith(".safetensors") else "pt"
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: must be one of {'|'.join(FORMATS)}")
    return fmt


def export_weights(
    path: str,
    out: str | Path,
    *,
    fmt: str | None = None,
    best: bool = False,
    ema: bool | None = None,
) -> ExportResult:
    """Write the consolidated model weights of the checkpoint at `path` to `out` (atomically).

    Args:
        path: a run folder, a checkpoint root, or one `step-<N>` folder (local or fsspec URL).
        out: the file to write (local).
        fmt: "pt" (`torch.save`) or "safetensors"; None: from `out`'s suffix.
        best: export the checkpoint `best` names instead of the newest.
        ema: export the EMA of the weights (`train.ema_decay`) or (False) the trained weights;
            None: those the training evaluated with (the EMA under its `train.ema_eval`).
    """
    fmt = format_of(out, fmt)
    if str(out).endswith(".json"):
        raise UsageError(
            f"{out}: a .json name is a model card's (an export writes its card to OUT.json); "
            "name the weights .pt or .safetensors"
        )
    if fmt == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise UsageError(
                "--format safetensors needs the safetensors package: "
                "pip install 'hpctrain[safetensors]'"
            ) from None
    store, name, manifest = locate_checkpoint(path, best=best)
    if ema is None:  # `--best` picked it by the weights the training evaluated with
        ema = bool(((config_tree(manifest) or {}).get("train") or {}).get("ema_eval"))
    weights = read_weights(store, name, manifest, ema=ema)
    out = Path(out)
    step = int(manifest["step"])
    card = model_card(manifest, weights, fmt)
    card_path = card_file(out) if card is not None else None

    def write_weights(f: Any) -> None:
        if fmt == "pt":
            torch.save(weights, f)
        else:
            from safetensors.torch import save

            # Tensors read from a checkpoint share no storage, so nothing needs de-duplication.
            metadata = {"hpctrain_step": str(step), "format": "pt"}
            if ema:
                metadata["hpctrain_weights"] = "ema"
            f.write(save(weights, metadata=metadata))

    write_atomic(out, write_weights, what="the export")
    if card_path is not None and card is not None:
        card["weights"] = out.name
        if ema:
            card["ema"] = True  # the weights are the EMA's (train.ema_decay)
        card_bytes = (json.dumps(card, indent=1) + "\n").encode()
        write_atomic(card_path, card_bytes, what="the export")
    return ExportResult(
        source=store.path(name),
        step=step,
        num_tensors=len(weights),
        num_elements=sum(v.numel() for v in weights.values()),
        out=out,
        model_card=card_path,
        ema=ema,
    )


def card_file(out: Path) -> Path:
    """The model card of the weights file `out`: `model.safetensors` → `model.safetensors.json`."""
    return out.with_name(out.name + ".json")


def config_tree(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The run's resolved config as a tree, from a checkpoint's manifest (None: none there)."""
    import yaml

    text = manifest.get("metadata", {}).get("config")
    try:
        tree = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        tree = None
    return tree if isinstance(tree, dict) else None


def model_card(
    manifest: dict[str, Any], weights: dict[str, torch.Tensor], fmt: str
) -> dict[str, Any] | None:
    """What rebuilds the model of these weights (the run's task's `model_card` hook), with
    the step and format, or None: a task without the hook (a custom task's model is the
    user's code), a checkpoint that carries no config, weights the card cannot rebuild."""
    tree = config_tree(manifest)
    card = task_model_card(tree, weights, manifest) if tree is not None else None
    if card is None:
        return None
    return {**card, "step": int(manifest["step"]), "format": fmt}


HF_SHARD_BYTES = 5 * 2**30  # transformers' default max_shard_size


def export_hf(
    path: str,
    out: str | Path,
    *,
    best: bool = False,
    ema: bool | None = None,
    shard_bytes: int = HF_SHARD_BYTES,
) -> ExportResult:
    """Write a causal_lm checkpoint as a Hugging Face model folder `out` (`--format hf`).

    `transformers.AutoModelForCausalLM.from_pretrained(out)` loads it without custom code:
    `config.json` (the architecture the run was imported from, else `LlamaForCausalLM`),
    `model.safetensors` (above `shard_bytes`, `model-0000N-of-0000M.safetensors` and
    `model.safetensors.index.json`), `generation_config.json` and, when the run's tokenizer is
    a tokenizer.json, that file with a `tokenizer_config.json` naming the end-of-document
    token as EOS. The folder is written beside `out` and renamed into place: an existing,
    non-empty `out` is refused, never overwritten.

    Raises:
        UsageError: not a causal_lm run (naming the formats that run exports to), or `out`
            in the way.
    """
    try:
        from safetensors.torch import save
    except ImportError:
        raise UsageError(
            "--format hf needs the safetensors package: pip install 'hpctrain[safetensors]'"
        ) from None

    from hpctrain.data.tokenizer import JSON
    from hpctrain.inference.generate import run_tokenizer
    from hpctrain.models import hf
    from hpctrain.tasks.causal_lm import CAUSAL_LM, gpt_config_for

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty folder; --format hf writes a new one")
    store, name, manifest = locate_checkpoint(path, best=best)
    tree = config_tree(manifest) or {}
    if tree.get("task") != CAUSAL_LM:
        raise UsageError(
            f"--format hf: a {tree.get('task', DEFAULT_TASK)} run has no Hugging Face "
            f"causal-LM counterpart; export it with --format {' or --format '.join(FORMATS)}"
        )
    if ema is None:
        ema = bool((tree.get("train") or {}).get("ema_eval"))
    weights = read_weights(store, name, manifest, ema=ema)
    cfg = gpt_config_for(tree, weights, store.path(name), manifest)
    # The source folder's architecture and token ids, as the run recorded them (a newer run)
    # or from the folder itself when it is still there.
    source_config: dict[str, Any] = manifest.get("metadata", {}).get("hf_config") or {}
    init_from = str((tree.get("model") or {}).get("init_from") or "")
    if not source_config and init_from and hf.is_hf_folder(init_from):
        source_config = hf.read_hf_config(init_from)
    architecture = (source_config.get("architectures") or ["LlamaForCausalLM"])[0]
    tokenizer = run_tokenizer(tree)
    eos = tokenizer.eod_id
    config = hf.hf_config(cfg, architecture, eos)
    for key in ("bos_token_id", "max_position_embeddings"):
        if key in source_config:
            config[key] = source_config[key]
    tensors = hf.hf_state_dict(weights, cfg)
    step = int(manifest["step"])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        shards = split_shards(tensors, shard_bytes)
        metadata = {"format": "pt", "hpctrain_step": str(step)}
        if len(shards) == 1:
            (tmp / hf.WEIGHTS).write_bytes(save(shards[0], metadata=metadata))
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                (tmp / file).write_bytes(save(shard, metadata=metadata))
                weight_map.update(dict.fromkeys(shard, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / hf.INDEX).write_text(json.dumps(index, indent=2) + "\n")
        (tmp / hf.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        generation = {"eos_token_id": eos, "do_sample": False}
        if "bos_token_id" in config:
            generation["bos_token_id"] = config["bos_token_id"]
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        if tokenizer.kind == JSON:  # other kinds (bytes, sentencepiece, tiktoken): no file
            shutil.copyfile(tokenizer.name, tmp / "tokenizer.json")
            eos_token = hf.special_token(Path(tokenizer.name), eos)
            tokenizer_config = {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos_token,
                "model_max_length": int((tree.get("data") or {}).get("seq_len") or 0) or 2048,
            }
            (tmp / "tokenizer_config.json").write_text(
                json.dumps(tokenizer_config, indent=2) + "\n"
            )
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(
        source=store.path(name),
        step=step,
        num_tensors=len(tensors),
        num_elements=sum(v.numel() for v in tensors.values()),
        out=out,
        ema=ema,
    )


def split_shards(
    tensors: dict[str, torch.Tensor], shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Tensors in name order, grouped into shards of at most `shard_bytes` (a larger tensor
    alone in its shard)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key in sorted(tensors):
        nbytes = tensors[key].numel() * tensors[key].element_size()
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensors[key]
        size += nbytes
    return shards


def export_peft(
    path: str, out: str | Path, *, best: bool = False, ema: bool | None = None
) -> ExportResult:
    """Write a LoRA run's adapters as a peft adapter folder `out` (`--format peft`):
    `adapter_config.json` and `adapter_model.safetensors` under peft's key names
    (`hpctrain.models.lora_peft`), so `peft.PeftModel.from_pretrained(base, out)` on the
    run's base (for causal_lm, the Hugging Face model of `model.init_from`) computes what the
    run computes. Written beside `out` and renamed into place, like `--format hf`.

    Raises:
        UsageError: not a LoRA run, or `out` in the way.
    """
    import logging

    from safetensors.torch import save

    from hpctrain.checkpoint.weights import read_model_weights
    from hpctrain.models.gpt import GPTConfig
    from hpctrain.models.lora import is_adapter
    from hpctrain.models.lora_base import lora_metadata
    from hpctrain.models.lora_peft import CONFIG, WEIGHTS, peft_adapter

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(
            f"{out}: exists and is not an empty folder; --format peft writes a new one"
        )
    store, name, manifest = locate_checkpoint(path, best=best)
    entry = lora_metadata(manifest)
    if entry is None:
        raise UsageError(
            f"--format peft: {store.path(name)} is not a LoRA run (model.lora.rank 0); export "
            f"it with --format {' or --format '.join((*FORMATS, 'hf'))}"
        )
    tree = config_tree(manifest) or {}
    if ema is None:
        ema = bool((tree.get("train") or {}).get("ema_eval"))
    trained = read_model_weights(store, name, manifest, ema=ema)  # adapters, not merged
    task = str(tree.get("task") or DEFAULT_TASK)
    shape = (manifest.get("metadata") or {}).get("gpt")
    gpt = GPTConfig(**shape) if task == "causal_lm" and isinstance(shape, dict) else None
    config, tensors = peft_adapter(trained, entry, gpt, task)
    left = sorted(
        k for k in trained if not is_adapter(k) and k not in entry.get("trained_in_full", [])
    )
    if left:  # e.g. BatchNorm statistics the run updated: the merged exports keep them
        logging.getLogger("hpctrain").warning(
            "--format peft: %d buffers the run updated are not part of a peft adapter (%s); "
            "--format safetensors keeps them",
            len(left),
            ", ".join(left[:3]),
        )
    step = int(manifest["step"])
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.mkdir(parents=True)
    try:
        (tmp / WEIGHTS).write_bytes(save(tensors, metadata={"format": "pt"}))
        (tmp / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        if out.exists():
            out.rmdir()  # empty (checked above)
        tmp.replace(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(
        source=store.path(name),
        step=step,
        num_tensors=len(tensors),
        num_elements=sum(v.numel() for v in tensors.values()),
        out=out,
        ema=ema,
    )
