"""Checks of where a causal_lm run's GPT shape comes from (`CausalLM.model_shape`): a
`model.name` preset against the folder or checkpoint that sets the shape, and a folder that
changed under a run whose checkpoints record its shape."""

from __future__ import annotations

import logging

from hpctrain.config import ConfigError
from hpctrain.models import hf
from hpctrain.models.gpt import GPTConfig, gpt_config

log = logging.getLogger(__name__)

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
