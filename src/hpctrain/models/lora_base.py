"""The base a LoRA run adapts: preparing the model, the base's fingerprint, and the run's
weights merged into the base.

A LoRA run's checkpoints hold the adapters (and what trains in full beside them), never the
base: the base stays where `model.init_from` names it. So every checkpoint records the base's
*fingerprint* (its folder and a digest of every byte: `hpctrain.models.lora_fingerprint`), a
resume refuses a base whose digest changed (the adapters were trained on other weights), and every verb that reads a LoRA run's
weights (eval, predict, generate, export) reads the base from the fingerprinted path, checks
it, and merges the adapters into it (`read_weights`: `W + (alpha / rank) B A`), so the
result is a plain model of the task, exported and evaluated like any other.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.checkpoint import CheckpointError
from hpctrain.checkpoint.storage import Store
from hpctrain.checkpoint.weights import read_model_weights
from hpctrain.config import Config, ConfigError
from hpctrain.errors import UsageError
from hpctrain.models import hf, init_from, lora
from hpctrain.models.gpt import GPTConfig
from hpctrain.models.lora_fingerprint import check_same_base, describe, fingerprint, same_base
from hpctrain.models.lora_peft import CONFIG as PEFT_CONFIG
from hpctrain.models.lora_peft import check_settings, read_peft_folder

log = logging.getLogger(__name__)
LORA_BASES = ("run", "full")  # the base a LoRA run's weights are merged into: `read_weights`
BATCHNORM_BUFFERS = ("running_mean", "running_var", "num_batches_tracked")
KEY = "lora"  # the checkpoint manifest's metadata entry of a LoRA run
ADAPTERS_KEY = "model.lora.init_from"


def prepare(model: nn.Module, cfg: Config, task: Any) -> lora.Adapted:
    """Load the base into the built `model` (unless it is on the meta device: the trainer
    loads each rank's shard after `parallelize`) and put the adapters on it (`apply_lora`).

    The base is loaded first because QLoRA quantizes loaded weights, and because a head that
    `model.init_from` re-initialises is known once it is read: it then trains in full.
    """
    fresh: list[str] = []
    if not any(p.is_meta for p in model.parameters()):
        line = init_from.load_initial_weights(model, cfg, task)
        log.info("LoRA base: %s", line)
    fresh = init_from.fresh_keys(model, cfg, task)
    return lora.apply_lora(model, cfg.model.lora, fresh=fresh)


def metadata(cfg: Config, base: dict[str, Any], adapted: lora.Adapted) -> dict[str, Any]:
    """What a LoRA run's checkpoints record: the adapters' settings and the base's fingerprint."""
    settings = cfg.model.lora
    return {
        "rank": settings.rank,
        "alpha": settings.alpha,
        "dropout": settings.dropout,
        "modules": list(adapted.modules),
        "trained_in_full": list(adapted.trained_in_full),
        "quantize_base": settings.quantize_base,
        "base_dtype": settings.base_dtype,
        "buffers": list(adapted.buffers),
        "base": base,
    }


def lora_metadata(manifest: dict[str, Any]) -> dict[str, Any] | None:
    """The LoRA entry of a checkpoint's manifest, or None for a run without adapters."""
    entry = (manifest.get("metadata") or {}).get(KEY)
    return entry if isinstance(entry, dict) else None


def read_weights(
    store: Store,
    name: str,
    manifest: dict[str, Any],
    *,
    ema: bool = False,
    lora_base: str = "run",
) -> dict[str, torch.Tensor]:
    """The plain model weights of checkpoint `name`: `read_model_weights`, with a LoRA run's
    adapters merged into its base (read from the fingerprinted path and checked).

    `lora_base`: "run", the base as the run held it and computed with (`held_base`: QLoRA's
    NF4 copy of the adapted layers, a `model.lora.base_dtype: bf16` base rounded to bf16), so
    that the merged model computes what the run's evaluations computed; "full": the base's
    own weights, as its folder holds them. The same for a run whose base was held as is.

    Raises:
        CheckpointError: the base is missing, unreadable, or not the one trained on.
        UsageError: a QLoRA base asked for as the run held it where torchao is missing.
    """
    trained = read_model_weights(store, name, manifest, ema=ema)
    entry = lora_metadata(manifest)
    if entry is None:
        return trained
    if lora_base not in LORA_BASES:
        raise UsageError(f"lora base {lora_base!r}: one of {', '.join(LORA_BASES)}")
    where = store.path(name)
    saved = entry["base"]
    try:
        current = fingerprint(saved["path"], ema=bool(saved.get("ema")), known=saved)
        check_same_base(saved, current, manifest.get("step"))
        base = read_base(saved["path"], manifest, ema=bool(saved.get("ema")))
    except ConfigError as exc:
        raise CheckpointError(f"{where}: a LoRA run whose base is unusable: {exc}") from None
    if lora_base == "run":
        base = held_base(base, entry, manifest, where)
    return lora.merge_adapters(base, trained, float(entry["alpha"]) / int(entry["rank"]))


def held_as(manifest: dict[str, Any]) -> str | None:
    """How a LoRA run held its frozen base: "nf4" (QLoRA: the adapted layers in NF4), "bf16"
    (`model.lora.base_dtype`), "fp32"; None for a run without adapters."""
    entry = lora_metadata(manifest)
    if entry is None:
        return None
    if entry.get("quantize_base") == "nf4":
        return "nf4"
    return base_dtype(entry, manifest)


def base_dtype(entry: dict[str, Any], manifest: dict[str, Any]) -> str:
    """The run's `model.lora.base_dtype` (an older checkpoint: from its recorded config)."""
    if "base_dtype" in entry:
        return str(entry["base_dtype"])
    import yaml

    text = (manifest.get("metadata") or {}).get("config")
    try:
        tree = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        tree = None
    model = (tree or {}).get("model") if isinstance(tree, dict) else None
    return str(((model or {}).get("lora") or {}).get("base_dtype") or "fp32")


def describe_base(manifest: dict[str, Any], lora_base: str) -> str | None:
    """Which base a LoRA run's weights were merged into, for a record or a line: "run (nf4)",
    "full"; None for a run without adapters."""
    held = held_as(manifest)
    if held is None:
        return None
    return f"run ({held})" if lora_base == "run" else "full"


def describe_configured_base(tree: dict[str, Any], lora_base: str) -> str | None:
    """`describe_base` from a run's resolved config (`model.lora.*`)."""
    settings = ((tree.get("model") or {}).get("lora") or {}) if isinstance(tree, dict) else {}
    if not settings.get("rank"):
        return None
    nf4 = settings.get("quantize_base") == "nf4"
    held = "nf4" if nf4 else str(settings.get("base_dtype") or "fp32")
    return f"run ({held})" if lora_base == "run" else "full"


@torch.no_grad()
def held_base(
    base: dict[str, torch.Tensor], entry: dict[str, Any], manifest: dict[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """The base's tensors as the run held them (see `read_weights`): what `apply_lora` did
    to the loaded base, done again (bf16 for every frozen parameter, then NF4 for each
    adapted layer's weight: the same values, quantization being deterministic)."""
    buffers = entry.get("buffers")
    if buffers is None:  # an older checkpoint: BatchNorm's statistics are the buffers
        buffers = [n for n in base if n.rsplit(".", 1)[-1] in BATCHNORM_BUFFERS]
    # the model's parameters are fp32 (a folder's bf16 tensors are loaded into them)
    held = {n: t.float() if t.is_floating_point() else t for n, t in base.items()}
    if base_dtype(entry, manifest) == "bf16":
        for name, tensor in held.items():
            if name not in buffers and tensor.is_floating_point():
                held[name] = tensor.to(torch.bfloat16)
    if entry.get("quantize_base") == "nf4":
        try:
            lora.require_nf4()
        except ConfigError:
            raise UsageError(
                f"{where}: a QLoRA run, evaluated on its NF4 base: that needs torchao (pip "
                "install 'hpctrain[qlora]'); or merge into the base's own weights "
                "(eval.lora_base=full, export/generate --lora-base full)"
            ) from None
        for module in entry.get("modules", []):
            weight = f"{module}.weight"
            if weight in held:
                nf4: Any = lora.to_nf4(held[weight], weight)  # torchao's NF4Tensor
                held[weight] = nf4.get_original_weight()
    return held


def read_base(path: str, manifest: dict[str, Any], *, ema: bool = False) -> dict[str, Any]:
    """The base's tensors under the task model's plain names, read whole in this process: a
    Hugging Face folder through the GPT shape the checkpoint records, else as `model.init_from`
    reads a run or a file."""
    if init_from.kind_of(path) != "hf":
        return init_from.read_state_dict(path, ema=ema)
    from safetensors import safe_open

    shape = (manifest.get("metadata") or {}).get("gpt")
    cfg = GPTConfig(**shape) if isinstance(shape, dict) else None
    if cfg is None:
        cfg = hf.gpt_config_from_hf(hf.read_hf_config(path), path)
    files = hf.weight_files(path)
    names = hf.hf_names(cfg)
    missing = sorted(theirs for theirs in names.values() if theirs not in files)
    if missing:
        raise ConfigError(f"{init_from.KEY}={path}: tensors missing: {lora.shown(missing)}")
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for ours, theirs in names.items():
        by_file.setdefault(files[theirs], []).append((ours, theirs))
    weights = {}
    for file, pairs in by_file.items():
        with safe_open(str(file), "pt") as opened:
            for ours, theirs in pairs:
                weights[ours] = opened.get_tensor(theirs)
    return weights


def start_adapters(model: nn.Module, cfg: Config, task: Any) -> str:
    """The adapters a new LoRA run starts from (`model.lora.init_from`, else fresh ones,
    `lora.initial_adapters`), written into the built, wrapped `model`; returns a log line."""
    source = cfg.model.lora.init_from
    if not source:
        lora.set_adapters(model, lora.initial_adapters(model, cfg.seed))
        return "fresh adapters (lora_B = 0: the model starts as its base)"
    gpt = getattr(task, "model_cfg", None)  # causal_lm: peft names are Hugging Face's
    values, in_full = read_adapters(source, cfg, gpt if isinstance(gpt, GPTConfig) else None)
    try:
        lora.set_adapters(model, values)
    except ConfigError as exc:
        raise ConfigError(f"model.lora.init_from={source}: {exc}") from None
    if in_full:
        load_in_full(model, in_full, source)
    return f"adapters from model.lora.init_from={source}"


@torch.no_grad()
def load_in_full(model: nn.Module, values: dict[str, torch.Tensor], source: str) -> None:
    """Copy the entries an adapter folder holds beside its adapters (peft's modules_to_save,
    a run's new head) into the model's parameters that train in full."""
    params = {
        hf.canonical_name(name): param
        for name, param in model.named_parameters()
        if param.requires_grad and not lora.is_adapter(hf.canonical_name(name))
    }
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise ConfigError(
            f"model.lora.init_from={source}: holds {lora.shown(unknown)}, which this run does "
            "not train in full (model.lora.modules_to_save)"
        )
    for name, value in values.items():
        if tuple(value.shape) != tuple(params[name].shape):
            raise ConfigError(
                f"model.lora.init_from={source}: {name} has shape {list(value.shape)}, the "
                f"model's {list(params[name].shape)}"
            )
        lora.copy_whole(params[name], value)


def read_adapters(
    source: str, cfg: Config, gpt: GPTConfig | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(adapters, entries trained in full) of `model.lora.init_from`, under our plain names.

    Raises:
        ConfigError: not an adapter folder or LoRA run, another rank or alpha, adapters of
            another base (an hpctrain run's fingerprint), keys of kinds LoRA here has not.
    """
    folder = Path(source)
    if (folder / PEFT_CONFIG).is_file():
        return read_peft_folder(folder, cfg, gpt)
    if not folder.exists():
        raise ConfigError(f"{ADAPTERS_KEY}={source}: no such folder")
    return read_lora_run(source, cfg)


def read_lora_run(
    source: str, cfg: Config
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """An hpctrain LoRA run's adapters, refused unless trained on this run's base."""
    from hpctrain.checkpoint.weights import locate_checkpoint

    try:
        store, name, manifest = locate_checkpoint(source)
        entry = lora_metadata(manifest)
        if entry is None:
            raise ConfigError(
                f"{ADAPTERS_KEY}={source}: neither a peft adapter folder ({PEFT_CONFIG}) "
                "nor a LoRA run"
            )
        check_settings(source, entry["rank"], entry["alpha"], cfg)
        base = fingerprint(cfg.model.init_from, ema=cfg.model.init_from_ema, known=entry["base"])
        if not same_base(entry["base"], base):
            raise ConfigError(
                f"{ADAPTERS_KEY}={source}: adapters of another base "
                f"({describe(entry['base'])}; this run's model.init_from: {describe(base)})"
            )
        trained = read_model_weights(store, name, manifest)
    except CheckpointError as exc:
        raise ConfigError(f"{ADAPTERS_KEY}={source}: {exc}") from None
    in_full = set(entry.get("trained_in_full", []))
    adapters = {k: v for k, v in trained.items() if lora.is_adapter(k)}
    return adapters, {k: v for k, v in trained.items() if k in in_full}
