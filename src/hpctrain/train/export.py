"""Export a training checkpoint as a consolidated, weights-only state dict.

A DCP checkpoint holds the model sharded (FSDP2) or replicated (DDP) across per-rank files,
next to the optimizer, scheduler, loader and RNG states. `export_weights` reads only the
model's entries (`app.model.*`, the fully qualified names of the plain module: DCP's
`get_state_dict` already strips DDP's `module.` and wrapper prefixes), in one process, and
writes them with `torch.save` so that `torch.load(path, weights_only=True)` gives a state dict
for `model.load_state_dict` of the plain, unwrapped model, or with the `safetensors` library
(`format="safetensors"`), which any tool loads without hpctrain or pickle.

With `ema=None` (the default) the weights are those the training evaluated with, as for every
verb that reads weights (eval, predict, generate): the EMA's when the run's `train.ema_eval`
is true, else the trained ones. With `ema=True` (`--ema`), the parameters are those of the EMA (`train.ema_decay`, stored as
`ema.<name>` beside `app.model.<name>`, see `hpctrain.train.ema`) and the buffers (BatchNorm
running statistics) those of the model.

For the built-in image classification task the export also writes `<out>.json` (the weights'
file name with `.json` added: `model.safetensors.json`, so two exports into one folder keep
their own cards; an `out` ending in `.json` is refused, it could be another export's card):
the task, model name, number and names of the classes (the checkpoint's), image size, the
normalization, the step, and how to rebuild the model; it is checked against the weights (every name and shape)
before it is written. For a `causal_lm` run the card holds the GPT's shape
(`GPTConfig`), the sequence length and how to rebuild the model (`train/generate.py`).
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hpctrain.checkpoint import CheckpointError, committed_steps, verify_checkpoint
from hpctrain.checkpoint.manager import BEST_NAME, item_checksums, read_latest, steps_to_try
from hpctrain.checkpoint.safety import SafeLoadPlanner, UnsafeCheckpointError
from hpctrain.checkpoint.storage import Store, open_store
from hpctrain.errors import UsageError

# `Trainer.checkpoint_states` stores ModelOptimizerState under "app", which puts the model under
# "model": DCP flattens nested keys with dots.
MODEL_PREFIX = "app.model."
EMA_PREFIX = "ema."  # hpctrain.train.ema.CHECKPOINT_KEY
FORMATS = ("pt", "safetensors")
IMAGE_CLASSIFICATION = "image_classification"


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


def locate_checkpoint(path: str, *, best: bool = False) -> tuple[Store, str, dict]:
    """(store, step folder name, manifest) for a run folder, a checkpoint root or a step folder.

    A run folder's checkpoints are where its `config.yaml` says (`checkpoint.dir`), else
    `RUN_DIR/checkpoints`. Of a root, the checkpoint a resume would load (the step `latest`
    names, or the highest below it that verifies; see `hpctrain.checkpoint.manager`), or with
    `best` the one the `best` pointer names (`checkpoint.keep_best`).
    """
    path = path.rstrip("/") or "/"
    parent, _, leaf = path.rpartition("/")
    parent_store = open_store(parent or ".")
    if parent_store.exists(f"{leaf}/manifest.json"):
        return parent_store, leaf, verify_checkpoint(parent_store, leaf)
    root = path
    config_path = Path(path) / "config.yaml"
    if "://" not in path and config_path.is_file():
        from hpctrain.config import load_config
        from hpctrain.config.schema import checkpoint_root

        root = checkpoint_root(load_config(str(config_path)).checkpoint.dir, path)
    store = open_store(root)
    steps = committed_steps(store)
    if best:
        step = read_latest(store, BEST_NAME)
        if step is None or step not in steps:
            raise CheckpointError(
                f"{root}: no best checkpoint (the `{BEST_NAME}` pointer is written by runs "
                "with checkpoint.monitor and checkpoint.keep_best)"
            )
        name = f"step-{step}"
        return store, name, verify_checkpoint(store, name)
    if not steps:
        raise CheckpointError(
            f"{path}: no committed checkpoint (give a run folder, a checkpoint folder or a step-<N> folder)"
        )
    problems = []
    for step in steps_to_try(steps, read_latest(store))[0]:
        name = f"step-{step}"
        try:
            return store, name, verify_checkpoint(store, name)
        except UnsafeCheckpointError:  # no fallback
            raise
        except CheckpointError as exc:
            problems.append(str(exc))
    raise CheckpointError(f"{root}: no loadable checkpoint ({'; '.join(problems)})")


def read_model_weights(
    store: Store, name: str, manifest: dict | None = None, *, ema: bool = False
) -> dict[str, torch.Tensor]:
    """The model's tensors of checkpoint `name`, consolidated in this process (no process group).

    With the `manifest` (from `verify_checkpoint`), every item read is checked against its
    CRC32C; `.metadata` is read through the same checks as a training load. With `ema`, the
    EMA's parameters replace the model's (its buffers stay).
    """
    checksums = item_checksums(manifest) if manifest is not None else None
    metadata = store.reader(name).read_metadata()
    weights: dict[str, torch.Tensor] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if key.startswith(MODEL_PREFIX) and isinstance(entry, TensorStorageMetadata):
            weights[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
    if not weights:
        raise CheckpointError(f"{store.path(name)}: holds no model weights ({MODEL_PREFIX}*)")
    if ema:
        averaged = {
            key: torch.empty(entry.size, dtype=entry.properties.dtype)
            for key, entry in metadata.state_dict_metadata.items()
            if key.startswith(EMA_PREFIX) and isinstance(entry, TensorStorageMetadata)
        }
        if not averaged:
            raise CheckpointError(
                f"{store.path(name)}: holds no EMA weights (the run trained without "
                "train.ema_decay); read its trained weights: without --ema "
                "(export, generate) or with train.ema_eval=false (eval, predict)"
            )
        names = [key[len(EMA_PREFIX) :] for key in averaged]
        unknown = sorted(n for n in names if MODEL_PREFIX + n not in weights)
        if unknown:
            raise CheckpointError(
                f"{store.path(name)}: EMA entries without a model weight: {unknown[:3]}"
            )
        for param_name in names:  # the model's copy is not read: the EMA's replaces it
            del weights[MODEL_PREFIX + param_name]
        weights.update(averaged)
    # DCP reads each tensor from every shard file that holds a piece of it (resharding to one).
    # no_dist: this process alone, also inside a job's process group (`hpctrain eval` ranks);
    # DCP then warns that it loads in one process, which is the intent.
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(
                weights,
                storage_reader=store.reader(name, checksums),
                planner=SafeLoadPlanner(),
                no_dist=True,
            )
    except CheckpointException as exc:
        inner = sorted(exc.failures.items())[0][1][0]
        text = str(inner).splitlines()[0] if str(inner) else type(inner).__name__
        kind = type(inner) if isinstance(inner, CheckpointError) else CheckpointError
        raise kind(f"{store.path(name)}: {text}") from None
    return {
        key[len(MODEL_PREFIX) if key.startswith(MODEL_PREFIX) else len(EMA_PREFIX) :]: value
        for key, value in weights.items()
    }


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
    weights = read_model_weights(store, name, manifest, ema=ema)
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

    _write_atomic(out, write_weights)
    if card_path is not None and card is not None:
        card["weights"] = out.name
        if ema:
            card["ema"] = True  # the weights are the EMA's (train.ema_decay)
        _write_atomic(card_path, lambda f: f.write((json.dumps(card, indent=1) + "\n").encode()))
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


def _write_atomic(out: Path, write: Any) -> None:
    """Write `out` through a temporary file, fsynced, then renamed: no half file on a kill."""
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with tmp.open("wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        tmp.replace(out)
    except OSError as exc:  # a folder in the way, a read-only place, a full disk
        raise UsageError(f"{out}: cannot write the export: {exc.strerror or exc}") from None
    finally:
        tmp.unlink(missing_ok=True)


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
    """What rebuilds a built-in image classification model for these weights, or None.

    None for other tasks (a custom task's model is the user's code) and for checkpoints that
    carry no config. The number of classes is that of the weights (`model.num_classes: 0`
    took it from the index); a model built from the card is checked to have exactly the
    weights' names and shapes.
    """
    tree = config_tree(manifest)
    if isinstance(tree, dict) and tree.get("task") == "causal_lm":
        from hpctrain.train.generate import lm_model_card

        try:
            card = lm_model_card(tree, weights, "checkpoint", manifest)
        except CheckpointError:
            return None  # weights the config does not describe: no card that could rebuild them
        return {**card, "step": int(manifest["step"]), "format": fmt}
    if not isinstance(tree, dict) or tree.get("task", IMAGE_CLASSIFICATION) != IMAGE_CLASSIFICATION:
        return None
    from hpctrain.train.classes import checkpoint_class_names
    from hpctrain.train.models import build_classifier
    from hpctrain.train.tasks.vision import MEAN, STD

    model_cfg = tree.get("model") or {}
    name = str(model_cfg.get("name") or "small_cnn")  # the task's default model
    image_size = int(model_cfg.get("image_size", 64))
    shapes = {key: tuple(value.shape) for key, value in weights.items()}

    def built_shapes(num_classes: int) -> dict[str, tuple[int, ...]]:
        with torch.device("meta"):  # shapes only: no memory, no initialisation cost
            model = build_classifier(name, num_classes, image_size)
        return {key: tuple(value.shape) for key, value in model.state_dict().items()}

    # The classifier's output layer is what depends on the number of classes: build with one
    # class and read the number from the weights where the shapes differ.
    probe = built_shapes(1)
    differing = [shapes[k][0] for k in shapes if k in probe and probe[k] != shapes[k]]
    num_classes = differing[0] if differing else 1
    if built_shapes(num_classes) != shapes:
        return None  # not a model the card could rebuild (a changed architecture)
    return {
        "task": IMAGE_CLASSIFICATION,
        "model": {
            "name": name,
            "num_classes": num_classes,
            "image_size": image_size,
            "channels_last": bool(model_cfg.get("channels_last", False)),
        },
        # the training index's, as the checkpoint stores them (empty: an older checkpoint)
        "class_names": list(checkpoint_class_names(manifest)),
        # logits: softmax over classes, or with multi_label a sigmoid per class
        "multi_label": bool((tree.get("classification") or {}).get("multi_label", False)),
        "input": {
            "layout": "NCHW RGB, resized (short side) and center-cropped to image_size",
            "scale": "uint8 values / 255",
            "mean": list(MEAN),
            "std": list(STD),
        },
        "step": int(manifest["step"]),
        "format": fmt,
        "versions": manifest.get("versions", {}),
        "rebuild": (
            "from hpctrain.train.models import build_classifier; "
            "model = build_classifier(name, num_classes, image_size)"
        ),
    }


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
    from hpctrain.train.generate import gpt_config_for, run_tokenizer
    from hpctrain.train.models import hf

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UsageError(f"{out}: exists and is not an empty folder; --format hf writes a new one")
    store, name, manifest = locate_checkpoint(path, best=best)
    tree = config_tree(manifest) or {}
    if tree.get("task") != "causal_lm":
        raise UsageError(
            f"--format hf: a {tree.get('task', IMAGE_CLASSIFICATION)} run has no Hugging Face "
            f"causal-LM counterpart; export it with --format {' or --format '.join(FORMATS)}"
        )
    if ema is None:
        ema = bool((tree.get("train") or {}).get("ema_eval"))
    weights = read_model_weights(store, name, manifest, ema=ema)
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
