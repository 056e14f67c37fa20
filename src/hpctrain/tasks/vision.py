"""What the built-in image tasks share: finding a sample's image field, normalizing on the device."""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.data.decode import SampleError
from hpctrain.data.fieldnames import is_image_field, is_target_field

# ImageNet statistics; images arrive as uint8 and are normalized on the device.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)


def find_field(sample: dict[str, Any], configured: str, kind: str, candidates: list[str]) -> str:
    """The field named `configured`, or else the one field among `candidates`.

    Raises:
        SampleError: the configured field is missing, or there is not exactly one candidate
            (the message names the key and the fields, and the config key that settles it).
    """
    key = sample.get("key", "?")
    if configured:
        if configured not in sample:
            fields = ", ".join(sorted(k for k in sample if k != "key"))
            raise SampleError(
                f"sample {key!r} has no {kind} field {configured!r} (fields: {fields})"
            )
        return configured
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        fields = ", ".join(sorted(k for k in sample if k != "key"))
        raise SampleError(f"sample {key!r} has no {kind} field (fields: {fields})")
    raise SampleError(
        f"sample {key!r} has several {kind} fields ({', '.join(sorted(candidates))}): name one in the config"
    )


def image_field(sample: dict[str, Any], configured: str = "") -> str:
    """The sample's image: `configured`, or its one image field that is not a target
    (`jpg`, `png`, `img.jpg`; not `mask.png`, `seg.png`, `depth.png`)."""
    candidates = [k for k in sample if is_image_field(k) and not is_target_field(k)]
    return find_field(sample, configured, "image", candidates)


def as_rgb(image: Any, key: str, field: str) -> torch.Tensor:
    """A decoded image field as a uint8 [3, H, W] tensor; a grey [H, W] image is repeated."""
    if not isinstance(image, torch.Tensor) or image.dtype != torch.uint8:
        raise SampleError(
            f"sample {key!r}: field {field!r} is not a uint8 image tensor "
            f"({type(image).__name__}{'' if not isinstance(image, torch.Tensor) else ' ' + str(image.dtype)})"
        )
    if image.ndim == 2:
        image = image.unsqueeze(0)
    if image.ndim == 3 and image.shape[0] == 1:
        return image.expand(3, -1, -1)
    if image.ndim == 3 and image.shape[0] == 3:
        return image
    raise SampleError(
        f"sample {key!r}: field {field!r} has shape {list(image.shape)}, not an image [3, H, W]"
    )


_STATS: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _stats(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and std (0-255 scale) on `device`, made once: a `torch.tensor(list, device=cuda)`
    per step is a blocking host-to-device copy."""
    if device not in _STATS:
        mean = torch.tensor(MEAN).view(1, 3, 1, 1) * 255
        std = torch.tensor(STD).view(1, 3, 1, 1) * 255
        _STATS[device] = (mean.to(device), std.to(device))
    return _STATS[device]


def normalize(images: torch.Tensor, channels_last: bool = False) -> torch.Tensor:
    """uint8 NCHW → float normalized with the ImageNet statistics, on the images' device."""
    mean, std = _stats(images.device)
    x = (images.float() - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def check_scale(scale_min: float, scale_max: float) -> tuple[float, float]:
    """`augment.scale_min/max` as RandomResizedCrop's `scale`, refused when inverted."""
    from hpctrain.config import ConfigError

    if scale_min > scale_max:
        raise ConfigError(f"augment.scale_min={scale_min} is above augment.scale_max={scale_max}")
    return (scale_min, scale_max)
