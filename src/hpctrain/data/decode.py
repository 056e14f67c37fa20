"""Default decoding of a sample's fields, by field name (the WebDataset conventions).

A sample is the tar members that share a key; the part of a member's name after `KEY.` is
its **field name** (`jpg`, `cls`, `img.jpg`, `mask.png`, `left.jpg`, `depth.npy`), kept with
its extensions. The decoder of a field is chosen by its LAST extension:

| last extension                                  | decoded value                            |
|-------------------------------------------------|------------------------------------------|
| `jpg jpeg png webp bmp tif tiff ppm pgm gif`    | uint8 CHW tensor, RGB [3, H, W] (below)  |
| `cls cls2 index id`                             | int                                      |
| `json`                                          | the JSON object                          |
| `txt text`                                      | str (UTF-8)                              |
| `npy`                                           | tensor (`np.load(allow_pickle=False)`)   |
| `pt pth`                                        | `torch.load(weights_only=True)`          |
| `u16 u32` (token ids, `hpctrain.data.tokens`)   | int64 tensor [num_ids]                   |
| anything else                                   | the raw bytes                            |

**Target fields.** An image field whose name contains `mask`, `seg`, `label` or `depth`
(`mask.png`, `seg.png`, `label.png`, `depth.png`, `instance_mask.tif`) is a target: when the
image is single-channel or a palette image, its raw values are kept, as an [H, W] tensor —
uint8 (a palette image's indices, which are class ids) or uint16 for 16-bit images — never
converted to RGB (that would turn class ids into colours). A colour image in a target field,
and every other image, becomes RGB [3, H, W] uint8 (16-bit images scaled to 8 bits).

**Decompression bombs.** Before any image is decoded, its width and height are read from its
header (PNG's IHDR, JPEG's SOF: a few microseconds; PIL's lazy `Image.open` for the other
formats) and an image of more than `max_pixels` pixels (`data.max_image_pixels`, default
PIL's `Image.MAX_IMAGE_PIXELS`) is refused with a `SampleError`: a 16000x16000 PNG of a few
hundred KB would otherwise allocate 768 MB per copy in a loader worker.

Every failure to decode a field (bad bytes, a bomb, an unknown image format) is a
`SampleError`, the per-sample data error that the loader handles under `data.on_error`.
"""

from __future__ import annotations

import contextlib
import io
import json
import struct
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np
import torch
from PIL import Image

from hpctrain.data.fieldnames import (
    IMAGE_EXTENSIONS,
    INT_EXTENSIONS,
    RESERVED_FIELDS,
    SOURCE_FIELD,
    TEXT_EXTENSIONS,
    TORCH_EXTENSIONS,
    is_target_field,
    last_extension,
)
from hpctrain.data.tokens import TOKEN_EXTENSIONS, decode_tokens
from hpctrain.errors import DataError

try:
    # imported here, not in the workers: forked workers then share it instead of each paying
    # the import (seconds each; it delayed a 2x2-worker job's first batch when it was lazy)
    from torchvision.io import ImageReadMode
    from torchvision.io import decode_image as tv_decode
except ImportError:  # a torchvision without image decoders: PIL decodes
    tv_decode = None

# PIL's own default; read once, so that a user raising PIL's global does not move ours
DEFAULT_MAX_PIXELS = int(Image.MAX_IMAGE_PIXELS or 89_478_485)
# PIL modes whose values are kept as they are in a target field (see the module docstring)
_RAW_MODES = frozenset({"1", "L", "P", "I;16", "I;16L", "I;16B", "I;16N", "I", "F"})

Sample = dict[str, Any]


class SampleError(DataError, ValueError):
    """One sample that cannot be used: an undecodable field, a decompression bomb, a label
    outside the model's classes. The loader handles it under `data.on_error` (fail: the
    error names the key and the shard; skip: counted, replaced by a filler flagged invalid).
    """


def decode_sample(
    key: str, members: Mapping[str, bytes | memoryview], *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Sample:
    """A sample's raw members -> `{"key": key, <field>: <decoded value>, ...}`.

    Args:
        key: the sample's key (the member names' common prefix).
        members: field name (`img.jpg`, `cls`...) -> the member's bytes.
        max_pixels: the largest image (width x height) decoded; 0: no limit.

    Raises:
        SampleError: a field that cannot be decoded (the message names the key and field).
    """
    sample: Sample = {"key": key}
    for name, data in members.items():
        if name == SOURCE_FIELD:
            continue  # provenance, not data (`hpctrain.data.fieldnames.SOURCE_FIELD`)
        if name in RESERVED_FIELDS:
            raise SampleError(
                f"sample {key!r}: a member named {key}.{name}: `{name}` is the loader's own "
                "field (the sample's key, its valid flag); rename the member"
            )
        try:
            sample[name] = decode_field(name, data, max_pixels=max_pixels)
        except SampleError as exc:
            raise SampleError(f"sample {key!r}: {exc}") from exc.__cause__
    return sample


def decode_field(
    name: str, data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS
) -> Any:
    """One field's bytes decoded by its last extension (see the module docstring).

    Raises:
        SampleError: the bytes are not what the extension says, or an image is too large.
    """
    ext = last_extension(name)
    try:
        if ext in IMAGE_EXTENSIONS:
            return _decode_image_field(name, data, max_pixels)
        if ext in INT_EXTENSIONS:
            text = bytes(data).strip()
            if not text:
                raise ValueError("empty")
            return int(text)
        if ext == "json":
            return json.loads(bytes(data))
        if ext in TEXT_EXTENSIONS:
            return bytes(data).decode("utf-8")
        if ext == "npy":
            return _decode_npy(data)
        if ext in TORCH_EXTENSIONS:
            return torch.load(io.BytesIO(bytes(data)), weights_only=True)
        if ext in TOKEN_EXTENSIONS:
            # int64, as the packed sequences of data.seq_len: what an embedding takes
            return torch.from_numpy(decode_tokens(data, name).astype(np.int64))
    except SampleError as exc:
        raise SampleError(f"field {name!r}: {exc}") from exc
    except Exception as exc:  # any decoder's complaint about these bytes is about the data
        reason = f"{type(exc).__name__}: {exc}".strip()
        raise SampleError(f"field {name!r} ({len(data)} bytes) cannot be decoded: {reason}") from (
            exc
        )
    return bytes(data)


def decode_image(data: bytes | memoryview, *, max_pixels: int = DEFAULT_MAX_PIXELS) -> torch.Tensor:
    """Encoded image bytes (or a view of them) -> uint8 RGB tensor [3, H, W].

    The decoder of every non-target image field. torchvision.io.decode_image for JPEG and PNG
    rather than PIL: faster on the same libjpeg-turbo (BENCHMARKS.md, "Figures behind the
    code"), and it gives the CHW tensor that `transforms.v2` wants without a copy.

    Raises:
        SampleError: more than `max_pixels` pixels (0: no limit), or undecodable bytes.
    """
    try:
        return _decode_image_field("image", data, max_pixels)
    except SampleError:
        raise
    except Exception as exc:
        raise SampleError(f"image ({len(data)} bytes) cannot be decoded: {exc}") from exc


# -- images -------------------------------------------------------------------------------


class _Header:
    """What an image's header tells before decoding: its size and whether it is one channel
    (grey or palette), and its bits per sample."""

    __slots__ = ("bits", "height", "single_channel", "width")

    def __init__(self, width: int, height: int, single_channel: bool, bits: int) -> None:
        self.width, self.height = width, height
        self.single_channel, self.bits = single_channel, bits


_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
# JPEG start-of-frame markers (baseline, progressive, lossless, arithmetic...): not C4 (DHT),
# C8 (reserved) or CC (DAC)
_JPEG_SOF = frozenset(
    {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
)


def read_header(data: bytes | memoryview) -> _Header | None:
    """Width, height and channels of a PNG (IHDR) or JPEG (SOF) from its first bytes; None
    for other formats or a header this parser does not follow (then PIL reads it)."""
    head = bytes(data[:33])
    if head.startswith(_PNG_SIGNATURE) and head[12:16] == b"IHDR":
        width, height, bits, colour_type = struct.unpack(">IIBB", head[16:26])
        return _Header(width, height, colour_type in (0, 3), bits)
    if head.startswith(b"\xff\xd8"):
        return _jpeg_header(data)
    return None


def _jpeg_header(data: bytes | memoryview) -> _Header | None:
    view = memoryview(data)
    pos, end = 2, len(view)
    while pos + 4 <= end:
        if view[pos] != 0xFF:
            return None
        marker = view[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        length = (view[pos + 2] << 8) | view[pos + 3]
        if marker in _JPEG_SOF:
            if pos + 10 > end:
                return None
            bits = view[pos + 4]
            height = (view[pos + 5] << 8) | view[pos + 6]
            width = (view[pos + 7] << 8) | view[pos + 8]
            return _Header(width, height, view[pos + 9] == 1, bits)
        if marker == 0xDA or length < 2:  # scan data before any frame header: not followed
            return None
        pos += 2 + length
    return None


def _check_pixels(width: int, height: int, max_pixels: int) -> None:
    if max_pixels and width * height > max_pixels:
        raise SampleError(
            f"image of {width}x{height} = {width * height:,} pixels is above "
            f"data.max_image_pixels = {max_pixels:,} (a decompression bomb?); not decoded"
        )


def _decode_image_field(name: str, data: bytes | memoryview, max_pixels: int) -> torch.Tensor:
    header = read_header(data)
    if header is None:
        return _decode_with_pil(name, data, max_pixels)
    _check_pixels(header.width, header.height, max_pixels)
    if header.single_channel and is_target_field(name):
        return _decode_with_pil(name, data, max_pixels)
    if tv_decode is None:
        return _decode_with_pil(name, data, max_pixels)
    image = _tv_decode_rgb(data)
    if image.dtype == torch.uint16:  # a 16-bit PNG: to 8 bits, as a colour image holds
        image = (image.to(torch.int32) >> 8).to(torch.uint8)
    return image


def _tv_decode_rgb(data: bytes | memoryview) -> torch.Tensor:
    # torchvision 0.29 warns on every call that these decoders move to torchcodec (not
    # installed here); PIL takes over once they are gone. The encoded bytes are read in
    # place: torch warns that the tensor over a read-only buffer must not be written to,
    # and the decoder only reads it.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        return tv_decode(torch.frombuffer(data, dtype=torch.uint8), mode=ImageReadMode.RGB)


@contextlib.contextmanager
def _pil_limit_off() -> Iterator[None]:
    """PIL's own bomb check off while the caller applies `max_pixels` itself: PIL refuses
    above twice its global whatever the user configured. Workers decode in one thread."""
    saved = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = None
    try:
        yield
    finally:
        Image.MAX_IMAGE_PIXELS = saved


def _decode_with_pil(name: str, data: bytes | memoryview, max_pixels: int) -> torch.Tensor:
    """Formats torchvision does not decode here, and target images with raw values."""
    with _pil_limit_off(), Image.open(io.BytesIO(data)) as image:  # lazy: the header only
        _check_pixels(image.width, image.height, max_pixels)
        if image.mode in _RAW_MODES and is_target_field(name):
            array = np.array(image)  # a copy: PIL's array interface is read-only
            if array.dtype == np.bool_:
                array = array.astype(np.uint8)
            elif not array.dtype.isnative:
                array = array.astype(array.dtype.newbyteorder("="))
            return torch.from_numpy(array)
        if image.mode.startswith("I;16"):  # 16-bit grey: scale to 8 bits, not clip
            array = np.asarray(image).astype(np.uint16) >> 8
            rgb = np.repeat(array.astype(np.uint8)[None], 3, axis=0)
            return torch.from_numpy(np.ascontiguousarray(rgb))
        array = np.array(image.convert("RGB"))
    return torch.from_numpy(array).permute(2, 0, 1).contiguous()


# -- arrays -------------------------------------------------------------------------------


def _decode_npy(data: bytes | memoryview) -> torch.Tensor:
    array = np.load(io.BytesIO(data), allow_pickle=False)
    if not array.dtype.isnative:  # torch takes native byte order only
        array = array.astype(array.dtype.newbyteorder("="))
    return torch.from_numpy(np.ascontiguousarray(array))
