"""Where a causal_lm run's GPT shape comes from (`CausalLM.model_shape`): a `model.name`
preset checked against the folder or checkpoint that sets the shape, a folder that changed
under a run whose checkpoints record its shape, and the shape of a finished run's
checkpoint (`gpt_config_for`: export, generate) with its model card."""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

import torch

from hpctrain.checkpoint import CheckpointError
from hpctrain.config import ConfigError
from hpctrain.models import hf
from hpctrain.models.gpt import GPT, GPTConfig, gpt_config

log = logging.getLogger(__name__)

CAUSAL_LM = "causal_lm"
EMBEDDING = "tok_embeddings.weight"

# What a preset fixes of a shape (the vocabulary and RoPE are the source's).
PRESET_KEYS = ("dim", "n_layers", "n_heads", "kv_heads", "hidden_dim", "tie_embeddings")


def check_preset(name: str, shape: GPTConfig, source: str) -> None:
    """Refuse a `model.name` preset whose shape is not `shape` (which `source`, a folder or a
    checkpoint, sets); one that agrees is said to change nothing; empty: nothing to check.

    Raises:
        ConfigError: naming the preset's values and the source's where they differ.
    """
    if not name:
        return
    preset = gpt_config(name, shape.vocab_size)
    differ = [k for k in PRESET_KEYS if getattr(preset, k) != getattr(shape, k)]
    if differ:
        ours = ", ".join(f"{k} {getattr(preset, k)}" for k in differ)
        theirs = ", ".join(f"{k} {getattr(shape, k)}" for k in differ)
        raise ConfigError(
            f"model.name={name} ({ours}) disagrees with {source} ({theirs}), which sets the "
            "model's shape; leave model.name empty"
        )
    log.info("model.name=%s: the shape is that of %s (the same)", name, source)


def warn_if_changed(folder: str, shape: GPTConfig, where: str) -> None:
    """Warn when the Hugging Face `folder` a run started from no longer gives the `shape`
    the checkpoint (`where`) records (a new revision at the same path): the record wins, the
    folder is read only for this warning (an unreadable one counts as changed)."""
    if not hf.is_hf_folder(folder):
        return  # gone, or not a folder: nothing needs it
    try:
        now: GPTConfig | None = hf.gpt_config_from_hf(hf.read_hf_config(folder), folder)
    except ConfigError:
        now = None
    if now != shape:
        log.warning(
            "%s=%s: its config.json is not what the run started from (changed or replaced); "
            "the shape %s recorded is used",
            hf.KEY,
            folder,
            where,
        )


def gpt_config_for(
    tree: dict[str, Any],
    weights: dict[str, torch.Tensor],
    where: str,
    manifest: dict[str, Any] | None = None,
) -> GPTConfig:
    """The GPTConfig of a causal_lm run's config `tree` whose weights are `weights`: the one
    the checkpoint's `manifest` records (`metadata.gpt`, written by runs since
    `model.init_from`), else rebuilt from the config (an older checkpoint of a run started
    from a Hugging Face folder: from that folder's config.json, as it is now).

    Raises:
        CheckpointError: not a causal_lm run, or weights that are not of the config's shape.
    """
    if tree.get("task") != CAUSAL_LM or EMBEDDING not in weights:
        raise CheckpointError(
            f"{where}: not a causal_lm checkpoint (task {tree.get('task')!r}); "
            "hpctrain generate needs a language model"
        )
    m = tree.get("model") or {}
    shape = tree.get("causal_lm") or m  # the shape keys were model.* before causal_lm.*
    recorded = ((manifest or {}).get("metadata") or {}).get("gpt")
    if isinstance(recorded, dict):
        try:
            cfg = GPTConfig(**recorded)
        except (TypeError, ConfigError) as exc:
            raise CheckpointError(f"{where}: its recorded GPT shape is unusable: {exc}") from None
    elif m.get("init_from"):  # the shape is that of the Hugging Face folder the run started from
        init_from = str(m["init_from"])
        log.info(
            "%s records no model shape (an older hpctrain saved it): the shape is read from %s=%s",
            where,
            hf.KEY,
            init_from,
        )
        try:
            cfg = hf.gpt_config_from_hf(hf.read_hf_config(init_from), init_from)
        except ConfigError as exc:
            raise CheckpointError(f"{where}: the run's shape is unknown: {exc}") from None
    else:
        cfg = gpt_config(
            str(m.get("name") or ""),
            int(weights[EMBEDDING].shape[0]),
            dim=int(shape.get("dim") or 0),
            n_layers=int(shape.get("n_layers") or 0),
            n_heads=int(shape.get("n_heads") or 0),
            n_kv_heads=int(shape.get("n_kv_heads") or 0),
            ffn_dim=int(shape.get("ffn_dim") or 0),
            tie_embeddings="output.weight" not in weights,
        )
    with torch.device("meta"):  # shapes only
        built = {k: tuple(v.shape) for k, v in GPT(cfg).state_dict().items()}
    if built != {k: tuple(v.shape) for k, v in weights.items()}:
        raise CheckpointError(
            f"{where}: the weights are not those of the GPT its config describes ({cfg})"
        )
    return cfg


def lm_model_card(
    tree: dict[str, Any],
    weights: dict[str, torch.Tensor],
    where: str,
    manifest: dict[str, Any] | None = None,
) -> dict:
    """What `hpctrain export` writes beside a causal_lm model's weights: its shape and tokens."""
    cfg = gpt_config_for(tree, weights, where, manifest)
    data = tree.get("data") or {}
    return {
        "task": CAUSAL_LM,
        "model": asdict(cfg),
        "seq_len": int(data.get("seq_len") or 0),
        "input": "token ids int64 [B, T] (T ≤ seq_len); output: logits [B, T, vocab_size]",
        "rebuild": (
            "from hpctrain.models.gpt import GPT, GPTConfig; "
            "model = GPT(GPTConfig(**card['model']))"
        ),
    }
