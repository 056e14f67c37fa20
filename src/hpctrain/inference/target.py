"""Which run an `eval` or `predict` command line names: a config, a run folder or a checkpoint.

Light on purpose (torch is imported only for a checkpoint target): the local launcher
resolves the command line before it starts the ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpctrain.config import Config, config_from_dict, load_config, with_overrides
from hpctrain.config.load import load_yaml
from hpctrain.data.index import redact_url
from hpctrain.errors import UsageError


def resolve_target(target: str, overrides: Sequence[str] = ()) -> tuple[Config, str | None]:
    """The config for `target`, and the checkpoint it names (None: choose by `--checkpoint`).

    `target` is a config file, a run folder (its `config.yaml`, with `run_dir` set to the
    folder), or one checkpoint (`.../step-<N>`, local or URL: the config saved in its
    manifest). `overrides` apply last.

    Raises:
        UsageError: `target` is none of these.
        ConfigError: a bad config key or value.
    """
    path = Path(target)
    if "://" not in target and path.is_file():
        return load_config(path, overrides), None
    if "://" not in target and (path / "config.yaml").is_file():
        return load_config(path / "config.yaml", [f"run_dir={path}", *overrides]), None
    from hpctrain.checkpoint import CheckpointError  # imports torch: only for a checkpoint
    from hpctrain.checkpoint.weights import locate_checkpoint

    try:
        _store, _name, manifest = locate_checkpoint(target)
    except CheckpointError as exc:
        if "://" in target or path.exists():
            raise UsageError(
                f"{redact_url(target)}: neither a config file, a run folder (config.yaml) "
                f"nor a checkpoint: {exc}"
            ) from None
        raise UsageError(f"{target}: no such file or folder") from None
    text = manifest.get("metadata", {}).get("config")
    if not isinstance(text, str):
        raise UsageError(f"{redact_url(target)}: the checkpoint's manifest holds no config")
    cfg = config_from_dict(load_yaml(text), f"{redact_url(target)}/manifest.json")
    return (with_overrides(cfg, overrides) if overrides else cfg), target
