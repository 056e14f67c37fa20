"""`model.init_from`: the weights a new run starts from (step 0, a fresh optimizer).

Three kinds of PATH (`kind_of`):
- `hf`: a Hugging Face folder (`config.json`) of a Llama-family causal LM, for `causal_lm`,
  which also takes the GPT's shape from it (`models/hf.py`).
- `run`: an hpctrain run folder, checkpoint root or `step-<N>` folder (a warm start): its
  model weights, or with `model.init_from_ema` its EMA's, read like `hpctrain export` reads
  them. Every key must match the run's model.
- `file`: a state dict file (`.pt`/`.pth`, `.safetensors`): an hpctrain export, or a
  torchvision download (`$TORCH_HOME/hub/checkpoints/resnet50-*.pth`). A tensor whose shape
  differs only in its first dimension, the model's number of classes (a classifier head of
  another number of classes), keeps the run's fresh initialisation and the log names it; any
  other tensor that would start anew (token embeddings of another vocabulary, K/V
  projections of other heads) is refused, naming it, unless
  `model.init_from_reinit_mismatched` (`match_keys`); other missing, unexpected or
  mis-shaped keys are an error listing them.

Loading goes through `set_model_state_dict(full_state_dict=True)`, which maps the plain
names onto DDP, FSDP2 (each rank keeps its shard), compiled and checkpoint-wrapped modules.

Under FSDP2 or HSDP (tensor parallelism included for a `run`) the model is built on the
meta device (`build_model`) when PATH is `hf`, or a `run` whose checkpoint holds every tensor
of the model at its shape: `parallelize` shards it and gives each rank storage for its shard
only (`to_empty`), then `load_hf_weights` fills every parameter from the folder, each rank its
own rows, or DCP reads each rank's pieces of the checkpoint, whatever mesh wrote it
(`load_model_weights_sharded`). A rank never holds the full model
(tests/models/test_init_from_meta.py; `hpctrain bench import` measures it). A `run` whose head
differs (another number of classes) is built as usual, and still read shard by shard. DDP and
a single process hold the full model anyway and read a `run` or `file` PATH whole; a `file`
is always read whole (a new head keeps the model's seeded initialisation).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.config import Config, ConfigError
from hpctrain.models import hf
from hpctrain.models.deferred_init import InitRecording, build_on_meta

log = logging.getLogger(__name__)
KEY = hf.KEY
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors")


def kind_of(path: str) -> str:
    """`hf`, `run` or `file` (see the module doc).

    Raises:
        ConfigError: a missing path (a hub name: how to download it), or a path of no known
            kind (a shard index, a folder of other files).
    """
    hf.check_path(path)
    p = Path(path)
    if p.is_dir():
        if hf.is_hf_folder(path):
            return "hf"
        if (p / "config.yaml").is_file() or (p / "manifest.json").is_file():
            return "run"
        if any(child.name.startswith("step-") for child in p.iterdir()):
            return "run"  # a checkpoint root
        raise ConfigError(
            f"{KEY}={path}: a folder that is neither a Hugging Face model folder (config.json) "
            "nor an hpctrain run or checkpoint folder"
        )
    if p.name.endswith(".json"):
        raise ConfigError(
            f"{KEY}={path}: a JSON file (an index or a model card), not weights; give the "
            f"folder that holds it or the weights file ({', '.join(FILE_SUFFIXES)})"
        )
    if not p.name.endswith(FILE_SUFFIXES):
        raise ConfigError(
            f"{KEY}={path}: not a weights file ({', '.join(FILE_SUFFIXES)}) nor a folder"
        )
    return "file"


def builds_on_meta(cfg: Config, strategy: str) -> bool:
    """Whether the run may build its model on the meta device (see the module doc;
    `build_model` also checks the model against what PATH holds)."""
    return (
        strategy in ("fsdp", "hsdp")
        and bool(cfg.model.init_from)
        and kind_of(cfg.model.init_from) in ("hf", "run")
        # QLoRA quantizes loaded weights before sharding (`models/lora.py`)
        and cfg.model.lora.quantize_base == "none"
    )


@dataclass(frozen=True)
class BuiltModel:
    """The task's model as built, and how its values come (see `build_model`)."""

    model: nn.Module
    # A fresh FSDP2/HSDP run's model built on the meta device: `init.materialize(model)` gives
    # each rank its shards of the values a CPU build has, once `parallelize` sharded it.
    init: InitRecording | None = None

    @property
    def on_meta(self) -> bool:
        return any(p.is_meta for p in self.model.parameters())


def build_model(task: Any, cfg: Config, strategy: str, *, tp: int = 1) -> BuiltModel:
    """The task's model, on the meta device where the run is sharded (no memory, no values:
    `parallelize` allocates each rank's shard, and the values come after it):

    - a fresh run (no `model.init_from`) under FSDP2/HSDP: with its initialisation recorded
      (`deferred_init.build_on_meta`; `BuiltModel.init` replays it into the shards, bitwise
      the CPU build's values), or whole on the CPU where the recording cannot replay it and
      under tensor parallelism;
    - when `builds_on_meta`: `load_initial_weights` fills the shards from PATH.

    Built as usual instead when PATH would not fill every tensor: a Hugging Face folder holds
    parameters only (a buffer's value, a table computed at construction, would be lost on the
    meta device; the GPT has none, its RoPE tables are made per forward), a run's checkpoint
    holds persistent buffers but not the others, and a tensor of another shape there (a new
    head) keeps its fresh initialisation.
    """
    if strategy in ("fsdp", "hsdp") and not cfg.model.init_from and tp == 1:
        model, init = build_on_meta(task.build_model)
        if init is not None:
            log.info("model built on the meta device: each rank initialises its own shards")
        return BuiltModel(model, init)
    if not builds_on_meta(cfg, strategy):
        return BuiltModel(task.build_model())
    with torch.device("meta"):
        model = task.build_model()
    if not fills_every_tensor(model, cfg):
        return BuiltModel(task.build_model())
    log.info("model built on the meta device: each rank reads its shard from %s", KEY)
    return BuiltModel(model)


def fills_every_tensor(model: nn.Module, cfg: Config) -> bool:
    """Whether `model.init_from` gives a value to every parameter and buffer of `model`."""
    path = cfg.model.init_from
    if kind_of(path) == "hf":
        return not any(True for _ in model.buffers())
    persistent = model.state_dict()
    if any(True for name, _ in model.named_buffers() if name not in persistent):
        return False
    wanted = {k: tuple(v.shape) for k, v in persistent.items()}
    return entry_shapes(open_run(path, ema=cfg.model.init_from_ema)[3]) == wanted


def open_run(path: str, *, ema: bool = False) -> tuple[Any, str, dict, dict]:
    """(store, step folder, manifest, model entries: `weights.weight_entries`) of a `run`
    PATH, located and checked once; a problem is a `ConfigError`."""
    from hpctrain.checkpoint import CheckpointError
    from hpctrain.checkpoint.weights import locate_checkpoint, weight_entries

    try:
        store, name, manifest = locate_checkpoint(path)
        refuse_adapters_only(path, manifest)
        return store, name, manifest, weight_entries(store, name, ema=ema)
    except CheckpointError as exc:
        raise ConfigError(f"{KEY}={path}: {exc}") from None


def refuse_adapters_only(path: str, manifest: dict) -> None:
    """A LoRA run's checkpoint holds its adapters, not a model to start from.

    Raises:
        ConfigError: naming the two ways to start from it.
    """
    if isinstance((manifest.get("metadata") or {}).get("lora"), dict):
        raise ConfigError(
            f"{KEY}={path}: a LoRA run (its checkpoints hold adapters, not the model): start "
            "from its merged weights (`hpctrain export RUN OUT.safetensors`, or --format hf) "
            "or continue its adapters with model.lora.init_from"
        )


def fresh_keys(model: nn.Module, cfg: Config, task: Any) -> list[str]:
    """The parameters of the built, unwrapped `model` that `model.init_from` leaves at their
    fresh initialisation (`match_keys`: a head of another number of classes), found from the
    shapes PATH holds; LoRA's adapters left aside."""
    from hpctrain.models.lora import is_adapter

    path = cfg.model.init_from
    kind = kind_of(path)
    if kind == "hf":
        return []  # a folder fills every parameter of the GPT its config.json shapes
    if kind == "run":
        source = entry_shapes(open_run(path, ema=cfg.model.init_from_ema)[3])
    else:
        source = {k: tuple(v.shape) for k, v in read_state_dict(path).items()}
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items() if not is_adapter(k)}
    parameters = {name for name, _ in model.named_parameters()}
    fresh = match_keys(source, expected, path, **reinit_rules(cfg, task))
    return [key for key in fresh if key in parameters]


def entry_shapes(entries: dict) -> dict[str, tuple[int, ...]]:
    """Plain name -> global shape of the model tensors `open_run` found."""
    return {plain: tuple(entry.size) for plain, (_, entry) in entries.items()}


def check(cfg: Config, task: Any) -> None:
    """Refuse, before any model is built, an init_from this run cannot use."""
    path = cfg.model.init_from
    if not path:
        if cfg.model.init_from_ema:
            raise ConfigError("model.init_from_ema=true: needs model.init_from (a run folder)")
        return
    kind = kind_of(path)
    if kind == "hf" and not hasattr(task, "hf_model_config"):
        raise ConfigError(
            f"{KEY}={path}: a Hugging Face causal-LM folder; task {cfg.task} cannot start from "
            "it (task causal_lm can)"
        )
    if kind == "run":  # a LoRA run's checkpoints hold no model to start from
        from hpctrain.checkpoint import CheckpointError
        from hpctrain.checkpoint.weights import locate_checkpoint

        try:
            refuse_adapters_only(path, locate_checkpoint(path)[2])
        except CheckpointError as exc:
            raise ConfigError(f"{KEY}={path}: {exc}") from None
    if cfg.model.init_from_ema and kind != "run":
        raise ConfigError(
            f"model.init_from_ema=true: {KEY}={path} is not a run or checkpoint folder (a "
            "weights file holds one set of weights: export it with --ema)"
        )


def read_state_dict(path: str, *, ema: bool = False) -> dict[str, torch.Tensor]:
    """The model tensors a `run` or `file` PATH holds, on the CPU."""
    if kind_of(path) == "run":
        from hpctrain.checkpoint import CheckpointError
        from hpctrain.checkpoint.weights import locate_checkpoint, read_model_weights

        try:
            store, name, manifest = locate_checkpoint(path)
            refuse_adapters_only(path, manifest)
            return read_model_weights(store, name, manifest, ema=ema)
        except CheckpointError as exc:
            raise ConfigError(f"{KEY}={path}: {exc}") from None
    try:
        if path.endswith(".safetensors"):
            from safetensors.torch import load_file

            return load_file(path)
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a damaged or foreign file: whatever its loader raises
        raise ConfigError(f"{KEY}={path}: not a readable state dict: {exc}") from None
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a training-script checkpoint around the weights
    if not isinstance(loaded, dict) or not all(
        isinstance(v, torch.Tensor) for v in loaded.values()
    ):
        raise ConfigError(f"{KEY}={path}: not a state dict (a mapping of names to tensors)")
    return loaded


def match_keys(
    source: dict[str, tuple[int, ...]],
    expected: dict[str, tuple[int, ...]],
    path: str,
    *,
    num_classes: int | None = None,
    reinit_mismatched: bool = False,
) -> list[str]:
    """The keys of `expected` to keep at their fresh initialisation: those whose shape in
    `source` (name -> shape) differs only in the first dimension, where that dimension is the
    model's number of classes (`num_classes`: a classifier head of another number of
    classes), or any such key with `reinit_mismatched` (`model.init_from_reinit_mismatched`).

    Raises:
        ConfigError: missing, unexpected or otherwise mis-shaped keys, listed; a tensor
            other than a head of classes (token embeddings of another vocabulary, K/V
            projections of other heads) that would start anew, named, unless opted in.
    """
    problems = []
    missing = sorted(set(expected) - set(source))
    unexpected = sorted(set(source) - set(expected))
    if missing:
        problems.append(f"missing keys: {', '.join(missing)}")
    if unexpected:
        problems.append(f"unexpected keys: {', '.join(unexpected)}")
    fresh, wrong, refused = [], [], []
    for key in sorted(set(source) & set(expected)):
        have, want = source[key], expected[key]
        if have == want:
            continue
        if len(have) == len(want) and have[1:] == want[1:]:
            if reinit_mismatched or (num_classes is not None and want[0] == num_classes):
                fresh.append(key)
            else:
                refused.append(f"{key} {list(have)} (the model's {list(want)})")
        else:
            wrong.append(f"{key} {list(have)} (the model's {list(want)})")
    if wrong:
        problems.append(f"shapes differ: {', '.join(wrong)}")
    if problems:
        raise ConfigError(f"{KEY}={path}: {'; '.join(problems)}")
    if refused:
        raise ConfigError(
            f"{KEY}={path}: would start anew, trained weights thrown away: {', '.join(refused)} "
            "(another vocabulary, other heads?); set model.init_from_reinit_mismatched=true "
            "to re-initialise them"
        )
    return fresh


def reinit_rules(cfg: Config, task: Any) -> dict[str, Any]:
    """`match_keys`' options for this run: the task's number of classes (its heads may start
    anew), and whether the user opted in for other tensors."""
    num_classes = getattr(task, "num_classes", None)
    return {
        "num_classes": num_classes if isinstance(num_classes, int) else None,
        "reinit_mismatched": cfg.model.init_from_reinit_mismatched,
    }


@torch.no_grad()
def load_initial_weights(
    model: nn.Module, cfg: Config, task: Any, *, process_group: Any = None
) -> str:
    """Copy `model.init_from`'s weights into the built, wrapped `model`; returns a log line.

    `process_group`: the group a sharded model's ranks read a `run` PATH over together (the
    checkpoint manager's; None: the default group).
    """
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )
    from torch.distributed.tensor import DTensor

    path = cfg.model.init_from
    kind = kind_of(path)
    if kind == "hf":
        unused = hf.load_hf_weights(model, path, task.model_cfg)
        return f"weights from {KEY}={path}" + (f" (unused: {', '.join(unused)})" if unused else "")
    from hpctrain.models.lora import is_adapter

    # Plain names; under FSDP2 the values are this rank's shards (nothing gathered). LoRA's
    # adapters are not the base's: the trainer starts them (`lora_base.start_adapters`).
    state = get_model_state_dict(model)
    adapters = any(is_adapter(k) for k in state)
    targets = {
        k: v
        for k, v in state.items()
        if isinstance(v, torch.Tensor) and not is_adapter(k)  # DTensors too
    }
    expected = {k: tuple(v.shape) for k, v in targets.items()}
    sharded = any(isinstance(v, DTensor) for v in targets.values())
    if kind == "run" and sharded:
        from hpctrain.checkpoint import CheckpointError
        from hpctrain.checkpoint.weights import load_model_weights_sharded

        store, name, manifest, entries = open_run(path, ema=cfg.model.init_from_ema)
        fresh = match_keys(entry_shapes(entries), expected, path, **reinit_rules(cfg, task))
        for key in fresh:
            del targets[key]
        try:  # each rank reads its own pieces, into `targets` in place
            load_model_weights_sharded(
                store, name, manifest, entries, targets, process_group=process_group
            )
        except CheckpointError as exc:
            raise ConfigError(f"{KEY}={path}: {exc}") from None
        # DCP wrote into `targets`, which are views of the parameters under FSDP2 and TP;
        # `set_model_state_dict` is the documented way to make them the model's under any
        # wrapper (one local copy of the rank's shard).
        values: dict[str, Any] = dict(targets)
        options = StateDictOptions(strict=not fresh and not adapters)
    else:
        source = read_state_dict(path, ema=cfg.model.init_from_ema)
        shapes = {k: tuple(v.shape) for k, v in source.items()}
        fresh = match_keys(shapes, expected, path, **reinit_rules(cfg, task))
        for key in fresh:
            del source[key]
        values = dict(source)
        options = StateDictOptions(full_state_dict=True, strict=not fresh and not adapters)
    set_model_state_dict(model, values, options=options)
    what = "EMA weights" if cfg.model.init_from_ema else "weights"
    line = f"{what} from {KEY}={path}"
    if sharded and kind == "run":
        line += " (each rank read its shards)"
    if fresh:
        line += f"; re-initialised (shapes differ): {', '.join(fresh)}"
    return line
