"""`model.lora.*` against the rest of the config: a pure function that the trainer and
`hpctrain preflight` both run, so a LoRA job that cannot train is refused on the login node.

What needs the model (targets that match nothing) or the installed packages (a QLoRA
backend) is checked when the model is built (`hpctrain.models.lora`), still before any work.
"""

from __future__ import annotations

from hpctrain.config.load import ConfigError
from hpctrain.config.schema import Config, LoraConfig

# The keys that only mean something with adapters, and their values when unset.
ADAPTER_KEYS = {
    "init_from": "",
    "targets": [],
    "modules_to_save": [],
    "base_dtype": "fp32",
    "quantize_base": "none",
}


def check_lora(cfg: Config) -> None:
    """Refuse `model.lora.*` settings that cannot train, in one line naming the key.

    Raises:
        ConfigError: a LoRA key set while LoRA is off, LoRA without a base to adapt, a bf16
            base under another compute dtype, or LoRA with tensor parallelism.
    """
    lora: LoraConfig = cfg.model.lora
    if not lora.rank:
        for key, unset in ADAPTER_KEYS.items():
            value = getattr(lora, key)
            if value != unset:
                raise ConfigError(
                    f"model.lora.{key}={value!r}: needs model.lora.rank > 0 (LoRA is off)"
                )
        return
    where = f"model.lora.rank={lora.rank}"
    if not cfg.model.init_from:
        raise ConfigError(
            f"{where}: needs model.init_from, the pretrained base the adapters adapt (a "
            "Hugging Face folder, an hpctrain run or a weights file)"
        )
    if lora.base_dtype == "bf16" and cfg.train.precision in ("fp32", "fp16"):
        raise ConfigError(
            f"model.lora.base_dtype=bf16: the base is held in the compute dtype, and "
            f"train.precision={cfg.train.precision} computes in another; set train.precision "
            "bf16 (or auto on a GPU with bf16), or model.lora.base_dtype fp32"
        )
    if cfg.train.tp_degree > 1:
        # Tensor parallelism's styles split nn.Linear weights and biases only; an adapter
        # beside them would meet DTensor inputs with plain weights. FSDP2 shards the
        # adapters with their blocks, which is what memory needs at LoRA's sizes.
        raise ConfigError(
            f"train.tp_degree={cfg.train.tp_degree} with {where}: LoRA adapters are not split "
            "by tensor parallelism; set train.tp_degree=1 (train.strategy fsdp or hsdp shards "
            "the base and the adapters)"
        )
