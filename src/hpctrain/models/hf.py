"""Hugging Face Llama-family folders in and out of the built-in GPT, with `safetensors` + `json`.

In: `model.init_from: FOLDER` (a `config.json` and `model.safetensors`, or shards listed by
`model.safetensors.index.json`) of `LlamaForCausalLM`, `MistralForCausalLM` or
`Qwen2ForCausalLM`. `gpt_config_from_hf` maps `config.json` to a `GPTConfig` (shape,
vocabulary, RoPE base and llama3 scaling, norm epsilon, tied embeddings, Qwen2's q/k/v biases);
`load_hf_weights` copies the tensors into a built (possibly DDP- or FSDP2-wrapped) GPT.

Rotary layout: Hugging Face's Llama code rotates channel pairs (i, i + head_dim/2)
("rotate_half") and its checkpoints store q/k projections for that layout (the conversion from
Meta's interleaved weights permuted them once). The built-in GPT uses the same half-split
layout (`gpt.apply_rotary`), so the weights are copied as they are, no permutation.

Memory under FSDP2: the trainer builds the GPT on the meta device, shards it and gives each
rank storage for its shard only (`init_from.build_model`); each rank then reads only its own
rows of each tensor, straight from the file into its shard (`read_rows`: the safetensors
header is JSON, the rows of a tensor are one contiguous byte range). No memory map: a rank's
resident memory is its shard plus at most one tensor's local rows (when the file's dtype is
not the parameter's), never the whole model's weights.

Out: `hf_config` and `hf_state_dict` give `hpctrain export --format hf` the `config.json` and
tensor names transformers' `AutoModelForCausalLM` loads without custom code.
"""

from __future__ import annotations

import json
import math
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hpctrain.config import ConfigError
from hpctrain.models.gpt import GPTConfig

KEY = "model.init_from"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
# A hub model id: `org/name`, nothing that looks like a local path.
HUB_NAME = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# Wrappers that add a component to parameter names: DDP's `module.`, torch.compile's
# `_orig_mod.`, activation checkpointing's `_checkpoint_wrapped_module.`.
WRAPPER_PARTS = ("module", "_orig_mod", "_checkpoint_wrapped_module")
# The two matrices of a LoRA adapter (`models/lora.py`), named as peft names them: a
# parameter under one of them is not the base's, so no folder holds it.
ADAPTERS = ("lora_A", "lora_B")


def is_hf_folder(path: str) -> bool:
    """Whether `path` is a folder holding a Hugging Face `config.json`."""
    return (Path(path) / CONFIG).is_file()


def check_path(path: str) -> None:
    """Refuse a `model.init_from` that is not on disk, in one line.

    Raises:
        ConfigError: no such path; for a hub id, how to download it on a login node.
    """
    if Path(path).exists():
        return
    if HUB_NAME.fullmatch(path) and not path.startswith("."):
        raise ConfigError(
            f"{KEY}={path}: no such folder; hpctrain never downloads (compute nodes are "
            f"offline): on a login node run `hf download {path} --local-dir DIR` "
            f"(`huggingface-cli download` with huggingface_hub older than 0.34) and set {KEY}=DIR"
        )
    raise ConfigError(f"{KEY}={path}: no such file or folder")


def read_hf_config(folder: str) -> dict[str, Any]:
    """The `config.json` of `folder`, refused unless of a supported architecture."""
    where = f"{KEY}={folder}"
    try:
        config = json.loads((Path(folder) / CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"{where}: cannot read {CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: {CONFIG} is not a JSON object")
    architectures = config.get("architectures") or [config.get("model_type")]
    if not isinstance(architectures, list) or architectures[0] not in ARCHITECTURES:
        raise ConfigError(
            f"{where}: architectures {architectures} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    return config


# The entries of a llama3 `rope_scaling` (or transformers 5's `rope_parameters`).
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
# What a run records of its folder's config.json besides the GPT's shape (`HFSource.recorded`):
# the architecture and token ids `export --format hf` writes back, and the sliding window
# (Mistral's) that the export keeps and the trainer checks `data.seq_len` against.
RECORDED_KEYS = (
    "architectures",
    "bos_token_id",
    "eos_token_id",
    "max_position_embeddings",
    "sliding_window",
    "use_sliding_window",
)


def number(config: dict[str, Any], key: str, kind: type, where: str, **options: Any) -> Any:
    """`config[key]` as `kind` (int or float); `options`: `default` (returned when the key is
    absent or null; without it the key is required) and `name` (the key's dotted place in
    config.json, e.g. `rope_scaling.factor`).

    Raises:
        ConfigError: absent without a default, or not a number: one line naming the folder
            (`where`), the file and the key.
    """
    name = options.get("name", key)
    value = config.get(key)
    if value is None:
        if "default" in options:
            return options["default"]
        raise ConfigError(f"{where}: {CONFIG} has no {name}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where}: {CONFIG}: {name} is {value!r}, not a number")
    if kind is int and value != int(value):
        raise ConfigError(f"{where}: {CONFIG}: {name} is {value!r}, not an integer")
    return kind(value)


def rope_settings(config: dict[str, Any], where: str) -> dict[str, Any]:
    """RoPE base and llama3 scaling as GPTConfig fields, from transformers 4's `rope_theta`
    + `rope_scaling` or transformers 5's `rope_parameters`.

    Raises:
        ConfigError: another kind of scaling, or a llama3 entry without one of its keys (one
            line naming the folder, the file and the key).
    """
    section = "rope_parameters" if config.get("rope_parameters") else "rope_scaling"
    params = config.get(section) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"{where}: {CONFIG}: {section} is {params!r}, not an object")
    theta = number(config, "rope_theta", float, where, default=10000.0)
    theta = number(params, "rope_theta", float, where, default=theta, name=f"{section}.rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return {"rope_theta": theta}
    if kind != "llama3":
        raise ConfigError(
            f"{where}: rope scaling of type {kind!r} is not supported (default or llama3)"
        )
    factor, low, high, original = (
        number(
            params,
            key,
            int if key.startswith("original") else float,
            where,
            name=f"{section}.{key} (rope_type llama3 needs {', '.join(LLAMA3_KEYS)})",
        )
        for key in LLAMA3_KEYS
    )
    return {
        "rope_theta": theta,
        "rope_scaling_factor": factor,
        "rope_low_freq_factor": low,
        "rope_high_freq_factor": high,
        "rope_original_max_positions": original,
    }


def gpt_config_from_hf(config: dict[str, Any], folder: str) -> GPTConfig:
    """The GPTConfig of a supported `config.json` (see `read_hf_config`).

    Raises:
        ConfigError: a feature the built-in GPT does not have (another activation, biases
            besides Qwen2's q/k/v, a head size other than dim / heads, sliding windows), or a
            key missing or not a number (naming the folder, the file and the key).
    """
    where = f"{KEY}={folder}"
    architecture = (config.get("architectures") or [""])[0]
    dim = number(config, "hidden_size", int, where)
    n_heads = number(config, "num_attention_heads", int, where)
    unsupported = []
    if config.get("hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act {config['hidden_act']!r}")
    if config.get("mlp_bias"):
        unsupported.append("mlp_bias")
    if config.get("attention_bias"):
        unsupported.append("attention_bias")
    if n_heads and config.get("head_dim") not in (None, dim // n_heads):
        unsupported.append(f"head_dim {config['head_dim']} != hidden_size / num_attention_heads")
    if config.get("use_sliding_window"):
        unsupported.append("use_sliding_window")
    if unsupported:
        raise ConfigError(f"{where}: {', '.join(unsupported)} not supported by the built-in GPT")
    shape = {
        "vocab_size": number(config, "vocab_size", int, where),
        "dim": dim,
        "n_layers": number(config, "num_hidden_layers", int, where),
        "n_heads": n_heads,
        "n_kv_heads": number(config, "num_key_value_heads", int, where, default=n_heads),
        "ffn_dim": number(config, "intermediate_size", int, where),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "norm_eps": number(config, "rms_norm_eps", float, where, default=1e-6),
        "qkv_bias": architecture == "Qwen2ForCausalLM",
        **rope_settings(config, where),
    }
    try:
        return GPTConfig(**shape)
    except ConfigError as exc:  # its checks name causal_lm.* keys: say where the values came from
        raise ConfigError(f"{where}: {CONFIG} gives a shape the GPT cannot take: {exc}") from None


@dataclass(frozen=True)
class HFSource:
    """What a run takes from a Hugging Face folder, read and checked once (`open_folder`)."""

    folder: str
    shape: GPTConfig
    recorded: dict[str, Any]  # the RECORDED_KEYS its config.json has


def sliding_window(recorded: dict[str, Any]) -> int:
    """The attention window of a model's recorded config.json entries (0: none, it attends
    to the whole context)."""
    window = recorded.get("sliding_window")
    if not window or not recorded.get("use_sliding_window", True):
        return 0
    return int(window)


def check_window(recorded: dict[str, Any], seq_len: int, source: str) -> None:
    """Refuse a `data.seq_len` longer than the model's sliding window: the built-in GPT
    attends to the whole sequence, the model to its window (the two agree up to it)."""
    window = sliding_window(recorded)
    if window and window < seq_len:
        raise ConfigError(
            f"data.seq_len={seq_len}: longer than the sliding_window {window} of {source} "
            "(the built-in GPT attends to the whole sequence)"
        )


def open_folder(folder: str, seq_len: int = 0) -> HFSource:
    """The folder's shape and recorded entries, after every check the trainer makes before it
    builds a model: a supported architecture and shape, safetensors weights (not `.bin`
    only), `data.seq_len` (`seq_len`; 0: unchecked) within the sliding window. `hpctrain
    preflight` runs the same on the login node.

    Raises:
        ConfigError: one line naming `model.init_from` (or `data.seq_len`) and the problem.
    """
    config = read_hf_config(folder)
    shape = gpt_config_from_hf(config, folder)
    weight_files(folder)
    recorded = {key: config[key] for key in RECORDED_KEYS if key in config}
    check_window(recorded, seq_len, f"{KEY}={folder}")
    return HFSource(folder=folder, shape=shape, recorded=recorded)


def check_against_model_keys(cfg: GPTConfig, model: Any, folder: str, where: str = CONFIG) -> None:
    """Refuse `causal_lm.*` dimensions set in the run's config that disagree with
    `config.json` (`model`: the run's CausalLMConfig); 0 / null leave them to the folder.
    `where` names what `cfg` was read from (a warm start's: the source run's config)."""
    explicit = {
        "dim": model.dim,
        "n_layers": model.n_layers,
        "n_heads": model.n_heads,
        "n_kv_heads": model.n_kv_heads,
        "ffn_dim": model.ffn_dim,
        "vocab_size": model.vocab_size,
        "tie_embeddings": model.tie_embeddings,
    }
    hf_value = {**{k: getattr(cfg, k) for k in explicit}, "n_kv_heads": cfg.kv_heads}
    for key, value in explicit.items():
        if value not in (0, None) and value != hf_value[key]:
            raise ConfigError(
                f"causal_lm.{key}={value} disagrees with {KEY}={folder} "
                f"({where}: {hf_value[key]}); leave causal_lm.{key} unset"
            )


def hf_names(cfg: GPTConfig) -> dict[str, str]:
    """The built-in GPT's parameter names → Hugging Face's, for this shape."""
    names = {
        "tok_embeddings.weight": "model.embed_tokens.weight",
        "norm.weight": "model.norm.weight",
    }
    if not cfg.tie_embeddings:
        names["output.weight"] = "lm_head.weight"
    layer = {
        "attention.wq": "self_attn.q_proj",
        "attention.wk": "self_attn.k_proj",
        "attention.wv": "self_attn.v_proj",
        "attention.wo": "self_attn.o_proj",
        "mlp.w1": "mlp.gate_proj",
        "mlp.w3": "mlp.up_proj",
        "mlp.w2": "mlp.down_proj",
        "attention_norm": "input_layernorm",
        "mlp_norm": "post_attention_layernorm",
    }
    for i in range(cfg.n_layers):
        for ours, theirs in layer.items():
            names[f"blocks.{i}.{ours}.weight"] = f"model.layers.{i}.{theirs}.weight"
        if cfg.qkv_bias:
            for ours in ("wq", "wk", "wv"):
                theirs = layer[f"attention.{ours}"]
                names[f"blocks.{i}.attention.{ours}.bias"] = f"model.layers.{i}.{theirs}.bias"
    return names


def weight_files(folder: str) -> dict[str, Path]:
    """Each tensor name of the folder → the safetensors file holding it."""
    root = Path(folder)
    where = f"{KEY}={folder}"
    if (root / INDEX).is_file():
        try:
            weight_map = json.loads((root / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as exc:
            raise ConfigError(f"{where}: cannot read {INDEX}: {exc}") from None
        files = {name: root / file for name, file in weight_map.items()}
        missing = sorted({str(p.name) for p in files.values() if not p.is_file()})
        if missing:
            raise ConfigError(f"{where}: {INDEX} names missing files: {', '.join(missing)}")
        return files
    if not (root / WEIGHTS).is_file():
        pickled = sorted(p.name for p in root.glob("*.bin"))
        if pickled:  # transformers' older format: a pickle, which hpctrain never loads
            raise ConfigError(
                f"{where}: PyTorch .bin weights only ({', '.join(pickled[:2])}), no {WEIGHTS} "
                f"or {INDEX}: hpctrain reads safetensors, never pickles; on a login node run "
                f"AutoModelForCausalLM.from_pretrained(FOLDER).save_pretrained(NEW_FOLDER) "
                f"(transformers writes safetensors) and set {KEY}=NEW_FOLDER"
            )
        raise ConfigError(f"{where}: neither {WEIGHTS} nor {INDEX} in the folder")
    return {name: root / WEIGHTS for name in read_header(root / WEIGHTS)[1]}


# safetensors' dtype names (https://github.com/huggingface/safetensors, "Format").
DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_header(path: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(offset of the data, tensor name → {dtype, shape, data_offsets}) of a safetensors file:
    8 bytes of little-endian header length, then the header as JSON."""
    where = f"{KEY}: {path}"
    try:
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(length))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where}: not a readable safetensors file: {exc}") from None
    if not isinstance(header, dict):
        raise ConfigError(f"{where}: not a safetensors file (its header is not a JSON object)")
    header.pop("__metadata__", None)
    return 8 + length, header


def read_rows(
    f: Any, data_start: int, entry: dict[str, Any], start: int, out: torch.Tensor
) -> None:
    """Read rows `start .. start + len(out)` of the tensor `entry` (a header entry) of the open
    safetensors file `f` into `out` (a CPU or GPU tensor, any float dtype).

    Rows along the first dimension are one contiguous byte range: read straight into `out`
    when it is a contiguous CPU tensor of the file's dtype, else through one buffer of those
    rows (then converted and copied)."""
    dtype = DTYPES[entry["dtype"]]
    shape = entry["shape"]
    row_bytes = math.prod(shape[1:]) * dtype.itemsize
    target = out
    if out.device.type != "cpu" or out.dtype != dtype or not out.is_contiguous():
        target = torch.empty(tuple(out.shape), dtype=dtype)
    f.seek(data_start + entry["data_offsets"][0] + start * row_bytes)
    view = target.detach().view(-1).view(torch.uint8).numpy().data  # a writable memoryview
    if f.readinto(view) != len(view):
        raise ConfigError(f"{KEY}: {f.name} ends inside its tensors (a truncated file)")
    if target is not out:
        out.copy_(target)


def canonical_name(name: str) -> str:
    """A parameter's name in the plain GPT, without the wrappers' components."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def local_rows(param: torch.Tensor) -> tuple[torch.Tensor, int] | None:
    """(the local tensor to write, first global row it holds) of a plain or FSDP2 parameter;
    None for a DTensor split otherwise (tensor parallelism: `read_split`).

    FSDP2 shards dim 0 like `torch.chunk`: rank r of the shard dimension holds rows from
    r · ceil(n / shard ranks); under HSDP the replicate dimension holds copies."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(param, DTensor):
        return param, 0
    placements = param.placements
    shard_dims = [i for i, p in enumerate(placements) if p == Shard(0)]
    others = [p for i, p in enumerate(placements) if i not in shard_dims]
    if len(shard_dims) != 1 or any(p != Replicate() for p in others):
        return None
    dim = shard_dims[0]
    rank, world = param.device_mesh.get_local_rank(dim), param.device_mesh.size(dim)
    local = param.to_local()
    return local, rank * math.ceil(param.shape[0] / world)


@torch.no_grad()
def load_hf_weights(model: nn.Module, folder: str, cfg: GPTConfig) -> list[str]:
    """Copy the folder's weights into `model` (a GPT of shape `cfg`, plain, DDP or FSDP2).

    Each rank reads only the rows of its own shard, straight into it (`read_rows`). Returns
    the names of the tensors of the folder left unused (a tied `lm_head.weight`, old
    `rotary_emb.inv_freq` buffers).

    Raises:
        ConfigError: tensors missing from the folder, or of another shape (naming them).
    """
    where = f"{KEY}={folder}"
    files = weight_files(folder)
    names = hf_names(cfg)
    missing = sorted(theirs for theirs in names.values() if theirs not in files)
    if missing:
        raise ConfigError(f"{where}: tensors missing: {', '.join(missing)}")
    headers = {path: read_header(path) for path in set(files.values())}
    with ExitStack() as stack:
        opened = {path: stack.enter_context(open(path, "rb")) for path in headers}
        for name, param in model.named_parameters():
            if any(part in ADAPTERS for part in name.split(".")):
                continue  # LoRA's adapters: initialised by the trainer, not the base
            theirs = names[canonical_name(name)]
            data_start, entries = headers[files[theirs]]
            entry = entries[theirs]
            if tuple(entry["shape"]) != tuple(param.shape):
                raise ConfigError(
                    f"{where}: {theirs} has shape {list(entry['shape'])}, the model's {name} "
                    f"{list(param.shape)}"
                )
            if entry["dtype"] not in DTYPES:
                raise ConfigError(f"{where}: {theirs} has dtype {entry['dtype']} (not read)")
            rows = local_rows(param)
            if rows is None:  # split along another dimension too (tensor parallelism)
                read_split(opened[files[theirs]], data_start, entry, param)
            elif rows[0].numel():
                read_rows(opened[files[theirs]], data_start, entry, rows[1], rows[0])
    return sorted(set(files) - set(names.values()))


def read_split(f: Any, data_start: int, entry: dict[str, Any], param: Any) -> None:
    """Fill DTensor `param`'s local shard from the tensor `entry` of the open safetensors file
    `f`, whatever its placements (tensor parallelism's column and row splits, FSDP2's strided
    shards over them): the tensor is read whole, in the file's dtype, and this rank keeps its
    piece (`distribute_tensor` without communication, `src_data_rank=None`). One tensor at a
    time: the largest (the embedding) is what a rank holds beyond its shards."""
    from torch.distributed.tensor import distribute_tensor

    full = torch.empty(tuple(entry["shape"]), dtype=DTYPES[entry["dtype"]])
    read_rows(f, data_start, entry, 0, full)
    piece = distribute_tensor(
        full.to(param.device), param.device_mesh, param.placements, src_data_rank=None
    )
    param.to_local().copy_(piece.to_local())


def special_token(tokenizer_json: Path, token_id: int) -> str:
    """The text of the special token `token_id` of a tokenizer.json (its `added_tokens`).

    Raises:
        ConfigError: the file has no such token (naming the file and the id).
    """
    added = json.loads(tokenizer_json.read_text()).get("added_tokens") or []
    for token in added:
        if isinstance(token, dict) and token.get("id") == token_id:
            return str(token["content"])
    raise ConfigError(f"{tokenizer_json}: no added token of id {token_id} (the EOD)")


def context_length(cfg: GPTConfig, source: dict[str, Any]) -> int:
    """The positions the model is meant for: the source folder's `max_position_embeddings`,
    else at least llama3's original context, at least 2048."""
    recorded = source.get("max_position_embeddings")
    if isinstance(recorded, int) and not isinstance(recorded, bool) and recorded > 0:
        return recorded
    return max(cfg.rope_original_max_positions, 2048)


def hf_config(cfg: GPTConfig, source: dict[str, Any], eos_id: int | None) -> dict[str, Any]:
    """A transformers `config.json` (written in transformers 4's keys, which 5 reads too).

    `source`: the entries the run recorded of the folder it was imported from
    (`RECORDED_KEYS`; {} for a run of hpctrain's own GPT): its architecture (else
    `LlamaForCausalLM`), BOS id, context length and sliding window are kept.
    """
    architecture = (source.get("architectures") or ["LlamaForCausalLM"])[0]
    if cfg.qkv_bias:
        architecture = "Qwen2ForCausalLM"  # the only supported one with q/k/v-only biases
    model_type = {
        "LlamaForCausalLM": "llama",
        "MistralForCausalLM": "mistral",
        "Qwen2ForCausalLM": "qwen2",
    }[architecture]
    config: dict[str, Any] = {
        "architectures": [architecture],
        "model_type": model_type,
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.kv_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.hidden_dim,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_embeddings,
        "max_position_embeddings": context_length(cfg, source),
        "torch_dtype": "float32",
        "attention_bias": False,
        "mlp_bias": False,
    }
    if model_type == "mistral":
        # The source's window (the run refused a data.seq_len beyond it, so training saw the
        # same attention); null would let transformers attend to the whole context.
        config["sliding_window"] = source.get("sliding_window")
    if model_type == "qwen2":
        config["use_sliding_window"] = False
        if "sliding_window" in source:
            config["sliding_window"] = source["sliding_window"]
    if "bos_token_id" in source:
        config["bos_token_id"] = source["bos_token_id"]
    if cfg.rope_scaling_factor:
        config["rope_scaling"] = {
            "rope_type": "llama3",
            "factor": cfg.rope_scaling_factor,
            "low_freq_factor": cfg.rope_low_freq_factor,
            "high_freq_factor": cfg.rope_high_freq_factor,
            "original_max_position_embeddings": cfg.rope_original_max_positions,
        }
    if eos_id is not None:
        config["eos_token_id"] = eos_id
    return config


def hf_state_dict(weights: dict[str, torch.Tensor], cfg: GPTConfig) -> dict[str, torch.Tensor]:
    """The built-in GPT's state dict under Hugging Face's names (contiguous, as safetensors
    wants)."""
    names = hf_names(cfg)
    return {names[name]: tensor.contiguous() for name, tensor in weights.items()}
