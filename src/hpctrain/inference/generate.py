"""Text from a trained `causal_lm` checkpoint: `hpctrain generate` (CPU or one GPU).

The weights are read like `hpctrain export` reads them (`checkpoint/weights.py`: any checkpoint
of a DDP or FSDP2 run, consolidated in this process). The model is rebuilt from the run's
resolved config (stored in every checkpoint's manifest) and checked against the weights; the
vocabulary is the embedding's and tied embeddings are recognised by the absent output matrix.
Generation keeps a key/value cache (`hpctrain.models.decoding`) and, on GPUs, runs in the
run's `train.precision` (autocast), in fp32 on CPUs.
"""

from __future__ import annotations

import math
import os
import warnings
from typing import Any, NamedTuple

import torch
import yaml

from hpctrain.checkpoint import CheckpointError
from hpctrain.checkpoint.weights import locate_checkpoint
from hpctrain.config import ConfigError
from hpctrain.data.locate import open_index
from hpctrain.data.tokenizer import (
    BYTES,
    UNKNOWN,
    Tokenizer,
    TokenizerError,
    check_tokenizer,
    describe_tokenizer,
    load_tokenizer,
    same_tokenizer,
)
from hpctrain.errors import DataError, UsageError
from hpctrain.models.decoding import decode
from hpctrain.models.gpt import GPT
from hpctrain.models.lora_base import read_weights  # a LoRA run: merged into its base
from hpctrain.parallel.precision import DTYPES, DeviceFacts, Precision, device_facts
from hpctrain.tasks.causal_lm import load_index_tokenizer
from hpctrain.tasks.lm_shape import gpt_config_for


def run_config(manifest: dict[str, Any], where: str) -> dict[str, Any]:
    """The run's resolved config tree from a checkpoint manifest (as written by the Trainer)."""
    text = manifest.get("metadata", {}).get("config")
    try:
        tree = yaml.safe_load(text) if isinstance(text, str) else None
    except yaml.YAMLError:
        tree = None
    if not isinstance(tree, dict):
        raise CheckpointError(f"{where}: the manifest holds no run config to rebuild the model")
    return tree


class LoadedGPT(NamedTuple):
    """A causal_lm checkpoint's model, ready to generate (`load_gpt`)."""

    model: GPT  # in eval mode, on the device asked for
    tree: dict[str, Any]  # the run's resolved config
    step: int
    tokenizer: dict[str, Any] | None  # the tokenizer record (None: an older checkpoint)


def load_gpt(
    source: str,
    *,
    best: bool = False,
    device: torch.device | None = None,
    ema: bool | None = None,
    lora_base: str = "run",
) -> LoadedGPT:
    """The model of a run folder or checkpoint, with the run's config and its tokenizer record.

    `ema`: read the EMA of the weights (`train.ema_decay`) instead of the trained ones; None
    (default): the weights the training evaluated with (EMA when its `train.ema_eval` was on).
    `lora_base`: a LoRA run's base, "run" (as the run held it) or "full" (`read_weights`).
    """
    store, name, manifest = locate_checkpoint(source, best=best)
    where = store.path(name)
    tree = run_config(manifest, where)
    if ema is None:
        ema = bool((tree.get("train") or {}).get("ema_eval"))
    with warnings.catch_warnings():
        # DCP's note that it loads without a process group: what this one process means to do
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        weights = read_weights(store, name, manifest, ema=ema, lora_base=lora_base)
    cfg = gpt_config_for(tree, weights, where, manifest)
    model = GPT(cfg)
    model.load_state_dict(weights)
    recorded = manifest.get("metadata", {}).get("tokenizer")
    return LoadedGPT(
        model.to(device or torch.device("cpu")).eval(),
        tree,
        int(manifest["step"]),
        recorded if isinstance(recorded, dict) else None,
    )


def generate_ids(
    model: GPT,
    prompt: list[int],
    *,
    max_new_tokens: int,
    window: int,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """The ids that follow `prompt`: greedy when `temperature` is 0, else sampled from the
    softmax of logits / temperature, restricted to the `top_k` most likely (0: all), with a
    generator seeded by `seed` (the same ids for the same seed). The model sees the last
    `window` ids (the training `data.seq_len`). Stops after `stop_id` (end of document).
    One prompt of `hpctrain.models.decoding.decode`, which keeps a key/value cache.
    """
    if not prompt:
        raise ValueError("the prompt holds no tokens")
    device = next(model.parameters()).device
    generator = torch.Generator(device=device).manual_seed(seed)
    (new,) = decode(
        model,
        [prompt],
        max_new_tokens=max_new_tokens,
        stop_ids=() if stop_id is None else (stop_id,),
        window=window,
        temperature=temperature,
        top_k=top_k,
        generator=generator,
    )
    return new


def generation_precision(
    tree: dict[str, Any], device: torch.device, facts: DeviceFacts | None = None
) -> Precision:
    """The precision a run's model decodes in: the run's `train.precision` on GPUs (bf16 or
    fp16 autocast, as it evaluated; `auto`: bf16 where the GPU has it, as `plan_training`
    decides), fp32 on CPUs (where bf16 is many times slower) and where the GPU lacks bf16.
    `facts`: the device's (looked up when None)."""
    name = str((tree.get("train") or {}).get("precision") or "fp32")
    if device.type != "cuda":
        return Precision(name="fp32", device_type=device.type, sharded=False)
    bf16_ok = (facts or device_facts(device)).bf16_ok
    if name == "auto":
        name = "bf16" if bf16_ok else "fp32"
    if name not in DTYPES or (name == "bf16" and not bf16_ok):
        name = "fp32"
    return Precision(name=name, device_type=device.type, sharded=False)


def generation_device(device: str) -> torch.device:
    """`--device`: cpu, cuda or cuda:N (one that exists here); default the first GPU, else cpu.

    Raises:
        UsageError: not such a device, or a GPU this machine does not have.
    """
    if not device:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        target = torch.device(device)
    except RuntimeError:
        target = None
    if target is None or target.type not in ("cpu", "cuda"):
        raise UsageError(f"--device {device}: not a device (cpu, cuda, cuda:N)")
    if target.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise UsageError(f"--device {device}: no CUDA GPU here; use --device cpu")
        if (target.index or 0) >= count:
            raise UsageError(
                f"--device {device}: this machine has {count} GPU(s), cuda:0 to cuda:{count - 1}"
            )
    return target


def generate_text(
    source: str,
    prompt: str,
    *,
    max_new_tokens: int = 200,
    temperature: float = 0.0,
    top_k: int = 0,
    seed: int = 0,
    best: bool = False,
    device: str = "",
    tokenizer_spec: str = "",
    ema: bool | None = None,
    lora_base: str = "run",
) -> str:
    """The continuation of `prompt` by the causal_lm checkpoint at `source` (see `generate_ids`)
    with its trained weights or their EMA (`ema`, see `load_gpt`).

    The tokenizer is `tokenizer_spec` when given, else the run's (`run_tokenizer`).

    Raises:
        UsageError: a bad option (negative counts, a negative or non-finite temperature, a
            device this machine lacks, a prompt that is not UTF-8).
        CheckpointError: no checkpoint there, or not a causal_lm one.
    """
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: must be at least 1")
    if top_k < 0:
        raise UsageError(f"--top-k {top_k}: must be at least 0")
    if not (math.isfinite(temperature) and temperature >= 0):  # NaN compares False
        raise UsageError(f"--temperature {temperature}: must be a finite number >= 0")
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError:  # bytes of another encoding, kept by Python as surrogates
        raise UsageError("--prompt: not UTF-8 text (convert it, e.g. with iconv)") from None
    target = generation_device(device)
    model, tree, _, recorded = load_gpt(
        source, best=best, device=target, ema=ema, lora_base=lora_base
    )
    tokenizer = run_tokenizer(tree, tokenizer_spec, recorded)
    ids = tokenizer.encode(prompt)
    if not ids:
        raise UsageError("--prompt: the text gives no tokens")
    window = int((tree.get("data") or {}).get("seq_len") or 0) or len(ids) + max_new_tokens
    with generation_precision(tree, target).autocast():
        new = generate_ids(
            model,
            ids,
            max_new_tokens=max_new_tokens,
            window=window,
            temperature=temperature,
            top_k=top_k,
            seed=seed,
            stop_id=tokenizer.eod_id,
        )
    if new and new[-1] == tokenizer.eod_id:
        new = new[:-1]
    return prompt + tokenizer.decode(new, unknown=UNKNOWN)


def run_tokenizer(
    tree: dict[str, Any], spec: str = "", recorded: dict[str, Any] | None = None
) -> Tokenizer:
    """The tokenizer of a causal_lm run.

    `spec` (`--tokenizer`: "bytes" or a tokenizer file) when given; else the one the
    checkpoint records (`recorded`: its absolute path, checked by sha256), or when that file
    is gone or changed, data.train's index's if it is the same tokenizer; else (an older
    checkpoint) the run's `data.tokenizer`, else its training index's, checked against that
    index when it can be read (a file by its sha256).

    Raises:
        UsageError: `spec` is not the tokenizer the checkpoint records; no tokenizer given
            and none to be found (the message says `--tokenizer`).
        DataError: the recorded file is gone or changed and data.train now holds another
            tokenizer's ids (naming both).
        ConfigError: (an older checkpoint) a tokenizer other than the one the index records.
    """
    data = tree.get("data") or {}
    if recorded:
        return recorded_tokenizer(recorded, spec, str(data.get("train") or ""))
    configured = spec or str(data.get("tokenizer") or "")
    train = str(data.get("train") or "")
    try:
        index = open_index(train)
    except DataError as exc:
        if not configured:
            raise UsageError(
                f"the run's training index {train!r} names its tokenizer but cannot be read "
                f"({exc}); give --tokenizer bytes|PATH"
            ) from None
        return load_tokenizer(configured)  # nothing to check it against
    key = "--tokenizer" if spec else "data.tokenizer"
    info = check_tokenizer(index, configured, train, key=key)
    try:
        return load_index_tokenizer(info, configured)
    except TokenizerError as exc:  # an index naming a relative path, read from elsewhere
        raise UsageError(f"{exc}; give --tokenizer bytes|PATH") from None


def recorded_tokenizer(recorded: dict[str, Any], spec: str, train: str) -> Tokenizer:
    """The tokenizer a checkpoint records (see `run_tokenizer`)."""
    model = f"the checkpoint's model was trained on {describe_tokenizer(recorded)}"
    if spec:
        given = load_tokenizer(spec)
        if not same_tokenizer({**given.info(), "eod_id": recorded.get("eod_id")}, recorded):
            raise UsageError(
                f"--tokenizer {spec}: {describe_tokenizer(given.info())} is not the tokenizer "
                f"the checkpoint's model was trained on, {describe_tokenizer(recorded)}"
            )
        given.eod_id = int(recorded["eod_id"])
        return given
    name = str(recorded.get("name") or "")
    why = ""
    if name == BYTES or os.path.isfile(name):
        tokenizer = load_tokenizer(name)
        if same_tokenizer({**tokenizer.info(), "eod_id": recorded.get("eod_id")}, recorded):
            tokenizer.eod_id = int(recorded["eod_id"])
            return tokenizer
        why = f"{name} is another file now (sha256 {tokenizer.sha256[:12]})"
    else:
        why = f"{name} is gone"
    try:  # the same tokenizer elsewhere: the one data.train's index names
        info = open_index(train).tokenizer
    except DataError:
        info = None
    if info and same_tokenizer(dict(info), recorded) and str(info["name"]) != name:
        try:
            return load_index_tokenizer(dict(info))
        except (TokenizerError, ConfigError):
            pass
    found = f"; data.train's index names {describe_tokenizer(dict(info))}" if info else ""
    raise DataError(f"{model}, but {why}{found}: give that tokenizer with --tokenizer PATH")
