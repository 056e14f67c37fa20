"""What a field's name says: which decoder reads it, and whether it is a target.

The one copy of the naming rules, shared by the loader's decoders (`hpctrain.data.decode`)
and by `hpctrain convert`, which writes each value so that it decodes back. Torch-free on
purpose: conversion workers import it without paying for `import torch`.
"""

from __future__ import annotations

IMAGE_EXTENSIONS = frozenset(
    {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "gif"}
)
INT_EXTENSIONS = frozenset({"cls", "cls2", "index", "id"})
TEXT_EXTENSIONS = frozenset({"txt", "text"})
TORCH_EXTENSIONS = frozenset({"pt", "pth"})
TARGET_MARKERS = ("mask", "seg", "label", "depth")
RESERVED_FIELDS = frozenset({"key", "valid"})  # set by the loader for every sample
# The path a sample was converted from (`KEY.__source__`, UTF-8 text; `hpctrain convert` writes
# it for image folders and manifests' path column). Provenance, not data: the loader never
# decodes it nor puts it into a training or evaluation batch (a Task's decode never sees it),
# so shards with and without it train alike; `hpctrain predict` writes it beside each
# prediction. Dunder-named, as webdataset's own `__key__`/`__url__`, so no data field meets it.
SOURCE_FIELD = "__source__"


def last_extension(name: str) -> str:
    """`img.seg.png` -> `png`; a name without a dot is its own extension (`cls` -> `cls`):
    what chooses a field's decoder."""
    return name.rsplit(".", 1)[-1].lower()


def is_target_field(name: str) -> bool:
    """True for field names that mark a target (`mask`, `seg`, `label` or `depth` in them):
    single-channel and palette images there keep their raw values, and convert never
    writes them lossy."""
    lowered = name.lower()
    return any(marker in lowered for marker in TARGET_MARKERS)


def is_image_field(name: str) -> bool:
    """True for fields the default decoders turn into image tensors."""
    return last_extension(name) in IMAGE_EXTENSIONS
