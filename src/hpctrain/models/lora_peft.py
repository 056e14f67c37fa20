"""LoRA adapters in peft's format, out (`hpctrain export --format peft`) and in
(`model.lora.init_from`).

A peft adapter folder is `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`,
`target_modules`, `modules_to_save`, ...) and `adapter_model.safetensors`, whose keys are the
base model's module names under `base_model.model.`, each adapter as `<module>.lora_A.weight`
(rank x in) and `<module>.lora_B.weight` (out x rank), and each module trained in full as its
own parameters (`<module>.weight`): the names peft 0.21 writes, read from its output. A base
whose output head is tied to its embedding gets the trained embedding as `lm_head` too (see
`peft_adapter`). The
base model of a causal_lm run is the Hugging Face model (`transformers`), so the GPT's module
names are mapped to Hugging Face's (`hf.hf_names`: `blocks.0.attention.wq` ->
`model.layers.0.self_attn.q_proj`); any other task's base is its own module, names unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from hpctrain.config import Config, ConfigError
from hpctrain.models import hf, lora
from hpctrain.models.gpt import GPTConfig

CONFIG = "adapter_config.json"
EMBEDDING = "tok_embeddings.weight"  # the GPT's; with tied embeddings, its output head too
HEAD = "lm_head"  # the Hugging Face model's output head
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."
KEY = "model.lora.init_from"


def tied_head(gpt: GPTConfig | None) -> bool:
    """Whether the base's output head is its embedding (`tie_word_embeddings`)."""
    return gpt is not None and gpt.tie_embeddings


def module_names(gpt: GPTConfig | None) -> dict[str, str]:
    """Our module name -> the base model's in peft's keys (identity: {} for a non-GPT)."""
    if gpt is None:
        return {}
    return {
        ours.removesuffix(".weight"): theirs.removesuffix(".weight")
        for ours, theirs in hf.hf_names(gpt).items()
        if ours.endswith(".weight")
    }


def rename(name: str, modules: dict[str, str]) -> str:
    """A parameter name with its module renamed by `modules` (kept when not listed)."""
    module, _, leaf = name.rpartition(".")
    if lora.is_adapter(name):
        module = lora.adapted_module(name)
        leaf = name[len(module) + 1 :]
    return f"{modules.get(module, module)}.{leaf}"


def target_modules(adapted: list[str], modules: dict[str, str], gpt: GPTConfig | None) -> list[str]:
    """peft's `target_modules`: the layers' last names (`q_proj`) when every layer of the GPT
    has each of them adapted (what vLLM expects), else the full module names."""
    theirs = [modules.get(m, m) for m in adapted]
    if gpt is not None:
        leaves = sorted({name.rsplit(".", 1)[-1] for name in theirs})
        if all(sum(n.endswith(f".{leaf}") for n in theirs) == gpt.n_layers for leaf in leaves):
            return leaves
    return theirs


def peft_adapter(
    trained: dict[str, torch.Tensor], entry: dict[str, Any], gpt: GPTConfig | None, task: str
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """(adapter_config.json, adapter_model.safetensors' tensors) of a LoRA checkpoint:
    `trained` its model entries (plain names), `entry` its manifest's LoRA record."""
    modules = module_names(gpt)
    in_full = [name for name in entry.get("trained_in_full", []) if name in trained]
    tensors = {
        PREFIX + rename(name, modules): value.contiguous()
        for name, value in sorted(trained.items())
        if lora.is_adapter(name) or name in in_full
    }
    saved_modules = sorted({modules.get(m, m) for m in (n.rpartition(".")[0] for n in in_full)})
    if tied_head(gpt) and EMBEDDING in in_full:
        # The GPT's output head is its embedding. peft keeps its own copy of each module to
        # save, and the base's lm_head stays tied to the base's (untrained) embedding: so
        # the trained embedding goes in as lm_head too (any peft version loads it so; its
        # `ensure_weight_tying` option would need peft 0.18 or newer).
        tensors[PREFIX + HEAD + ".weight"] = trained[EMBEDDING].clone()  # its own bytes
        saved_modules = sorted({*saved_modules, HEAD})
    name, revision = base_name(str(entry["base"]["path"]))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if task == "causal_lm" else None,
        "base_model_name_or_path": name,
        "revision": revision,
        "r": int(entry["rank"]),
        "lora_alpha": float(entry["alpha"]),
        "lora_dropout": float(entry.get("dropout", 0.0)),
        "target_modules": target_modules(list(entry["modules"]), modules, gpt),
        "modules_to_save": saved_modules or None,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
    }
    return config, tensors


def base_name(path: str) -> tuple[str, str | None]:
    """(`base_model_name_or_path`, `revision`) of the base at `path`: its Hugging Face Hub name
    and revision where the folder is a snapshot of the Hub's cache
    (`.../models--ORG--NAME/snapshots/REV`, what `hf download ORG/NAME` without `--local-dir`
    writes), so that peft (`AutoPeftModel`) and other machines find the base by it; else the
    absolute path the run read it from. (A `config.json`'s `_name_or_path` is not taken: a
    fine-tune's often names the model it was tuned from.)"""
    folder = Path(path)
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        org_name = folder.parent.parent.name.removeprefix("models--")
        if "--" in org_name:
            return org_name.replace("--", "/", 1), folder.name
    return path, None


def check_settings(source: str, rank: Any, alpha: Any, cfg: Config) -> None:
    ours = cfg.model.lora
    if int(rank) != ours.rank or float(alpha) != ours.alpha:
        raise ConfigError(
            f"{KEY}={source}: adapters of rank {rank} and alpha {alpha}; this run's are "
            f"model.lora.rank={ours.rank}, model.lora.alpha={ours.alpha:g}: set them alike"
        )


def read_peft_folder(
    folder: Path, cfg: Config, gpt: GPTConfig | None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    where = f"{KEY}={folder}"
    try:
        config = json.loads((folder / CONFIG).read_text())
        tensors = load_file(folder / WEIGHTS)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: not a readable peft adapter folder: {exc}") from None
    if config.get("peft_type") != "LORA" or config.get("use_dora") or config.get("use_rslora"):
        raise ConfigError(
            f"{where}: a {config.get('peft_type')} adapter"
            f"{' with DoRA' if config.get('use_dora') else ''}"
            f"{' with rsLoRA scaling' if config.get('use_rslora') else ''}; plain LoRA only"
        )
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ConfigError(f"{where}: per-layer ranks or alphas (rank_pattern, alpha_pattern)")
    check_settings(str(folder), config.get("r"), config.get("lora_alpha"), cfg)
    ours = {theirs: mine for mine, theirs in module_names(gpt).items()}
    adapters: dict[str, torch.Tensor] = {}
    in_full: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not key.startswith(PREFIX):
            raise ConfigError(f"{where}: key {key!r} is not under {PREFIX!r}")
        name = rename(key[len(PREFIX) :], ours)
        (adapters if lora.is_adapter(name) else in_full)[name] = value
    head = in_full.pop(f"{HEAD}.weight", None)
    if head is not None and tied_head(gpt):
        # a tied base: the head is the embedding (`peft_adapter` writes it as both)
        embedding = in_full.get(EMBEDDING)
        if embedding is None or not torch.equal(head, embedding):
            raise ConfigError(
                f"{where}: holds an lm_head other than its embedding; this run's base ties "
                "them (tie_word_embeddings), so one matrix cannot hold both"
            )
    elif head is not None:
        in_full[f"{HEAD}.weight"] = head  # not the GPT's: named as it is
    return adapters, in_full
