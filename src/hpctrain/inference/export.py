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
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hpctrain.checkpoint.weights import locate_checkpoint
from hpctrain.errors import UsageError, install_hint
from hpctrain.files import write_atomic
from hpctrain.models.lora_base import describe_base, read_weights  # LoRA: merged into its base
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
    lora_base: str | None = None  # a LoRA run: the base merged into ("run (nf4)", "full")
    held: str | None = None  # --format peft: how the run held its base (nf4, bf16, fp32)


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
    lora_base: str = "run",
) -> ExportResult:
    """Write the consolidated model weights of the checkpoint at `path` to `out` (atomically).

    Args:
        path: a run folder, a checkpoint root, or one `step-<N>` folder (local or fsspec URL).
        out: the file to write (local).
        fmt: "pt" (`torch.save`) or "safetensors"; None: from `out`'s suffix.
        best: export the checkpoint `best` names instead of the newest.
        ema: export the EMA of the weights (`train.ema_decay`) or (False) the trained weights;
            None: those the training evaluated with (the EMA under its `train.ema_eval`).
        lora_base: a LoRA run's adapters merged into its base as the run held it ("run") or
            into its own weights ("full"): `hpctrain.models.lora_base.read_weights`.
    """
    fmt = format_of(out, fmt)
    if Path(out).is_dir():
        raise UsageError(
            f"{out}: a folder; the export is one file: name it (e.g. {Path(out) / 'model.pt'}), "
            "or use --format hf for a Hugging Face folder"
        )
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
                "--format safetensors needs the safetensors package: " + install_hint("safetensors")
            ) from None
    store, name, manifest = locate_checkpoint(path, best=best)
    if ema is None:  # `--best` picked it by the weights the training evaluated with
        ema = bool(((config_tree(manifest) or {}).get("train") or {}).get("ema_eval"))
    weights = read_weights(store, name, manifest, ema=ema, lora_base=lora_base)
    merged_into = describe_base(manifest, lora_base)
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
            if merged_into:
                metadata["hpctrain_lora_base"] = merged_into
            f.write(save(weights, metadata=metadata))

    write_atomic(out, write_weights, what="the export")
    if card_path is not None and card is not None:
        card["weights"] = out.name
        if ema:
            card["ema"] = True  # the weights are the EMA's (train.ema_decay)
        if merged_into:
            card["lora_base"] = merged_into  # the base the adapters were merged into
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
        lora_base=merged_into,
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
    tokenizer_spec: str = "",
    lora_base: str = "run",
) -> ExportResult:
    """Write a causal_lm checkpoint as a Hugging Face model folder `out` (`--format hf`).

    `transformers.AutoModelForCausalLM.from_pretrained(out)` loads it without custom code:
    `config.json` (the shape and the imported folder's entries the checkpoint records: the
    architecture, else `LlamaForCausalLM`, the context, the sliding window), `model.safetensors`
    (above `shard_bytes`, `model-0000N-of-0000M.safetensors` and
    `model.safetensors.index.json`), `generation_config.json` and the tokenizer the checkpoint
    records (`tokenizer_spec`: `--tokenizer`, which must be the same one): a tokenizer.json
    with the tokenizer files of its folder (`TOKENIZER_FILES`: the chat template, special
    tokens), and a `tokenizer_config.json` whose `model_max_length` is the model's context.
    The `model.init_from` folder is never read when the checkpoint records what it took from
    it. The folder is written beside `out` and renamed into place: an existing, non-empty
    `out` is refused, never overwritten; a link to an empty folder gets the export in that
    folder.

    Raises:
        UsageError: not a causal_lm run (naming the formats that run exports to), `out` in
            the way or the current folder, a `--tokenizer` other than the run's, a write that
            fails (a full disk: naming the path and "No space left on device").
    """
    try:
        from safetensors.torch import save
    except ImportError:
        raise UsageError(
            "--format hf needs the safetensors package: " + install_hint("safetensors")
        ) from None

    from hpctrain.data.tokenizer import JSON
    from hpctrain.inference.generate import run_tokenizer
    from hpctrain.inference.hf_tokenizer import check_auto_tokenizer, write_tokenizer
    from hpctrain.models import hf
    from hpctrain.tasks.lm_shape import CAUSAL_LM, gpt_config_for

    target = hf_target(out)
    store, name, manifest = locate_checkpoint(path, best=best)
    tree = config_tree(manifest) or {}
    if tree.get("task") != CAUSAL_LM:
        raise UsageError(
            f"--format hf: a {tree.get('task', DEFAULT_TASK)} run has no Hugging Face "
            f"causal-LM counterpart; export it with --format {' or --format '.join(FORMATS)}"
        )
    if ema is None:
        ema = bool((tree.get("train") or {}).get("ema_eval"))
    weights = read_weights(store, name, manifest, ema=ema, lora_base=lora_base)
    merged_into = describe_base(manifest, lora_base)
    cfg = gpt_config_for(tree, weights, store.path(name), manifest)
    metadata = manifest.get("metadata") or {}
    # The source folder's entries as the run recorded them; an older checkpoint: the folder's
    # config.json as it is now, when it is still there.
    source_config: dict[str, Any] = dict(metadata.get("hf_config") or {})
    init_from = str((tree.get("model") or {}).get("init_from") or "")
    if "gpt" not in metadata and init_from and hf.is_hf_folder(init_from):
        source_config = hf.read_hf_config(init_from)
    recorded = metadata.get("tokenizer")
    tokenizer = run_tokenizer(
        tree, tokenizer_spec, recorded if isinstance(recorded, dict) else None
    )
    eos = tokenizer.eod_id
    config = hf.hf_config(cfg, source_config, eos)
    if merged_into:  # transformers keeps unknown entries as attributes of the config
        config["hpctrain_lora_base"] = merged_into
    tensors = hf.hf_state_dict(weights, cfg)
    step = int(manifest["step"])
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    try:
        writer = FolderWriter(tmp, target)
        shards = split_shards(tensors, shard_bytes)
        metadata = {"format": "pt", "hpctrain_step": str(step)}
        if len(shards) == 1:
            writer.write(hf.WEIGHTS, save(shards[0], metadata=metadata))
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                writer.write(file, save(shard, metadata=metadata))
                weight_map.update(dict.fromkeys(shard, file))
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            writer.write_json(hf.INDEX, index)
        writer.write_json(hf.CONFIG, config)
        generation = {"eos_token_id": eos, "do_sample": False}
        if "bos_token_id" in config:
            generation["bos_token_id"] = config["bos_token_id"]
        writer.write_json("generation_config.json", generation)
        warning = None
        if tokenizer.kind == JSON:  # other kinds (bytes, sentencepiece, tiktoken): no file
            write_tokenizer(writer, tokenizer, init_from, eos, config["max_position_embeddings"])
            # what transformers' AutoTokenizer makes of the folder, against the run's encodings
            warning = check_auto_tokenizer(writer, tokenizer, Path(out))
        writer.commit()
        if warning:
            logging.getLogger("hpctrain").warning("%s", warning)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return ExportResult(
        source=store.path(name),
        step=step,
        num_tensors=len(tensors),
        num_elements=sum(v.numel() for v in tensors.values()),
        out=Path(out),
        ema=ema,
        lora_base=merged_into,
    )


def hf_target(out: str | Path) -> Path:
    """The folder `--format hf` writes: `out`, or the folder a link `out` points to.

    Raises:
        UsageError: `out` is a file or a folder with files, or the current folder (`.`,
            `./`) or one above it, which a new folder cannot replace.
    """
    target = Path(os.path.realpath(out))
    here = Path.cwd().resolve()
    if target == here or target in here.parents:
        raise UsageError(
            f"{out}: the current folder (or one above it); --format hf writes a new folder: "
            f"give its name (e.g. {Path(out) / 'hf-model'})"
        )
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        shown = f"{out} (a link to {target})" if target != Path(out).absolute() else f"{out}"
        raise UsageError(
            f"{shown}: exists and is not an empty folder; --format hf writes a new one"
        )
    return target


class FolderWriter:
    """Files of a new folder written under a temporary name, renamed into place whole.

    A write that fails (a full disk, a quota) is one `UsageError` naming the file and why
    ("No space left on device"); the caller removes the temporary folder.
    """

    def __init__(self, tmp: Path, target: Path) -> None:
        self.tmp, self.target = tmp, target
        self.attempt(target, lambda: tmp.mkdir(parents=True))

    def attempt(self, path: Path, action: Any) -> Any:
        try:
            return action()
        except OSError as exc:
            raise UsageError(f"{path}: cannot write the export: {exc.strerror or exc}") from None

    def write(self, name: str, data: bytes) -> None:
        def write() -> None:
            (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
            (self.tmp / name).write_bytes(data)

        self.attempt(self.target / name, write)

    def write_json(self, name: str, value: Any) -> None:
        self.write(name, (json.dumps(value, indent=2) + "\n").encode())

    def read_json(self, name: str) -> dict[str, Any]:
        """A JSON object written (or copied) into the folder; {} when there is none."""
        path = self.tmp / name
        if not path.is_file():
            return {}
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as exc:
            raise UsageError(f"{name} of the tokenizer's folder: not JSON ({exc})") from None
        return value if isinstance(value, dict) else {}

    def copy(self, source: Path, name: str) -> None:
        def copy() -> None:
            (self.tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(source, self.tmp / name)

        self.attempt(self.target / name, copy)

    def commit(self) -> None:
        """Rename the folder into place; an empty folder there (one `hf_target` let through)
        is replaced in the same rename."""
        self.attempt(self.target, lambda: os.replace(self.tmp, self.target))


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

    from safetensors.torch import save

    from hpctrain.checkpoint.weights import read_model_weights
    from hpctrain.models.gpt import GPTConfig
    from hpctrain.models.lora import is_adapter
    from hpctrain.models.lora_base import held_as, lora_metadata
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
        held=held_as(manifest),
    )
