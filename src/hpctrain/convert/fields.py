"""Field names and values: which column or value becomes which member, with which bytes.

A sample is the tar members sharing a key; the member name after `KEY.` is the field name,
which keeps its extensions (`img.jpg`, `mask.png`, `depth.npy`, `cls`, `json`). The loader
decodes a field by its last extension (`hpctrain.data.decode`); these rules write each value
so that it decodes back to what the source held:

| value (Python sources and Arrow) / column (manifests)  | member                                   |
|--------------------------------------------------------|------------------------------------------|
| a path or URL (a manifest's file column)               | the file's bytes, copied                  |
| bytes                                                  | the bytes, under the field's name         |
| PIL image                                              | `name.jpg/.jpeg` JPEG (quality 95); any other image extension: that format; no extension: `name.png` (lossless) |
| numpy array / torch tensor                             | `name.npy` (`np.save`); under an image extension: that image format (HW or HWC arrays, HW or CHW tensors, uint8, or uint16 PNG) |
| int (not bool)                                         | `name.cls` (or the name when it ends in `cls cls2 index id`): the integer as text |
| str                                                    | `name.txt` (or the name when it ends in `txt text`): UTF-8 |
| float, bool, dict, list                                | `name.json` (or the name when it ends in `json`): JSON |
| None                                                   | no member                                 |

The extension rules are the loader's own (`hpctrain.data.fieldnames`, torch-free).
"""

from __future__ import annotations

import io
import json
import posixpath
from typing import Any

from hpctrain.data.fieldnames import (
    IMAGE_EXTENSIONS,
    INT_EXTENSIONS,
    SOURCE_FIELD,
    TEXT_EXTENSIONS,
    is_target_field,
    last_extension,
)
from hpctrain.errors import DataError

# Extensions that say "this column holds paths of files to copy" in a manifest.
FILE_EXTENSIONS = IMAGE_EXTENSIONS | frozenset(
    {"npy", "npz", "pt", "pth", "bin", "wav", "flac", "mp3", "mp4", "webm"}
    | {f"{kind}{bits}" for kind in "uif" for bits in (8, 16, 32, 64)}  # raw arrays: tokens.u16
)
# PIL's format name for each image extension it writes.
_PIL_FORMATS = {
    "jpg": "JPEG",
    "jpeg": "JPEG",
    "png": "PNG",
    "webp": "WEBP",
    "bmp": "BMP",
    "tif": "TIFF",
    "tiff": "TIFF",
    "ppm": "PPM",
    "pgm": "PPM",
    "gif": "GIF",
}
JPEG_QUALITY = 95


def check_field_name(name: str, where: str) -> str:
    """The field name, lowercased (the loader lowercases it when reading), or a `DataError`."""
    if not name or name.startswith(".") or name.endswith(".") or "/" in name or "\\" in name:
        raise DataError(f"{where}: {name!r} cannot be a field name (empty, '/' or a dot at an end)")
    if any(ch.isspace() or ord(ch) < 32 for ch in name):
        raise DataError(f"{where}: field name {name!r} holds whitespace or control characters")
    if name.lower() == SOURCE_FIELD:
        raise DataError(f"{where}: {name!r} is hpctrain's field (the sample's source path)")
    return name.lower()


def file_extension(url: str) -> str:
    """The lowercased extension of the file a path or URL names ("" when it has none)."""
    base = posixpath.basename(url.split("?", 1)[0])
    return base.rsplit(".", 1)[-1].lower() if "." in base.strip(".") else ""


def int_text(value: Any) -> bytes:
    """An integer label as the text of a `cls` member (a ValueError for anything else)."""
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float, str))
        or (isinstance(value, float) and not value.is_integer())
    ):
        raise ValueError(f"{value!r} is not an integer")
    if isinstance(value, str):
        value = value.strip()
        if not value.lstrip("-").isdigit():
            raise ValueError(f"{value!r} is not an integer")
    return str(int(value)).encode()


def json_bytes(value: Any) -> bytes:
    """Canonical JSON (sorted keys, no spaces): the same value always gives the same bytes."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"not JSON-serializable: {exc}") from None


def scalar_member(column: str, value: Any, *, csv_text: bool) -> bytes | None:
    """The member bytes of a manifest/Arrow scalar column, by its name; None: goes to `json`.

    `cls`/`cls2`/`*.cls`: an integer; `txt`/`text`/`*.txt`: UTF-8 text; `json`/`*.json`: JSON
    (in a CSV the cell is JSON text, parsed first). Raises ValueError for a value that does
    not fit its column.
    """
    ext = last_extension(column)
    if ext in ("cls", "cls2"):
        return int_text(value)
    if ext in TEXT_EXTENSIONS:
        return (value if isinstance(value, str) else json.dumps(value)).encode()
    if ext == "json":
        if csv_text:
            try:
                value = json.loads(value)
            except ValueError:
                raise ValueError("not valid JSON text") from None
        return json_bytes(value)
    return None


def encode_image(image: Any, field: str) -> tuple[str, bytes]:
    """A PIL image as (field name, encoded bytes) by the field's extension (see module doc)."""
    ext = last_extension(field)
    if ext not in IMAGE_EXTENSIONS or "." not in field:
        field, ext = f"{field}.png", "png"
    pil_format = _PIL_FORMATS[ext]
    if pil_format == "JPEG" and is_target_field(field):
        raise ValueError(
            f"target field {field!r} would lose its values (class ids, depths) as JPEG; "
            "name the field .png"
        )
    if pil_format == "JPEG" and image.mode not in ("RGB", "L", "CMYK"):
        image = image.convert("RGB")
    out = io.BytesIO()
    options: dict[str, Any] = {"quality": JPEG_QUALITY} if pil_format == "JPEG" else {}
    if pil_format == "WEBP":
        options = {"lossless": True}
    image.save(out, format=pil_format, **options)
    return field, out.getvalue()


def _array_image(array: Any, field: str, from_tensor: bool) -> tuple[str, bytes]:
    from PIL import Image

    if from_tensor and array.ndim == 3:  # torch's CHW -> PIL's HWC
        array = array.transpose(1, 2, 0)
    if array.ndim == 3 and array.shape[2] == 1:
        array = array[:, :, 0]
    if array.dtype.name not in ("uint8", "uint16") or array.ndim not in (2, 3):
        raise ValueError(
            f"an array of shape {tuple(array.shape)} and dtype {array.dtype} is not an image "
            "(uint8 HW/HWC arrays, HW/CHW tensors; uint16 HW for PNG); name the field .npy"
        )
    if array.dtype.name == "uint16" and (array.ndim != 2 or last_extension(field) != "png"):
        raise ValueError("uint16 arrays are written as 16-bit PNG only (HW, a .png field)")
    image = Image.fromarray(array.copy() if not array.flags.c_contiguous else array)
    return encode_image(image, field)


def encode_value(field: str, value: Any) -> tuple[str, bytes] | None:
    """(member field name, bytes) of one value of a Python sample; None for None.

    Raises:
        ValueError: a value of a type with no encoding, or one its field name cannot hold.
    """
    import numpy as np

    ext = last_extension(field)
    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return field, bytes(value)
    if type(value).__module__.startswith("PIL.") and hasattr(value, "save"):
        return encode_image(value, field)
    is_tensor = type(value).__module__.startswith("torch") and hasattr(value, "numpy")
    if is_tensor or isinstance(value, np.ndarray):
        array = value.detach().cpu().numpy() if is_tensor else value
        if "." in field and ext in IMAGE_EXTENSIONS:
            return _array_image(array, field, from_tensor=is_tensor)
        if array.dtype == object:
            raise ValueError("an object array cannot be written without pickle")
        name = field if ext == "npy" else f"{field}.npy"
        out = io.BytesIO()
        np.save(out, np.ascontiguousarray(array), allow_pickle=False)
        return name, out.getvalue()
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, (bool, float, dict, list, tuple)):
        return (field if ext == "json" else f"{field}.json"), json_bytes(value)
    if isinstance(value, int):
        return (field if ext in INT_EXTENSIONS else f"{field}.cls"), str(value).encode()
    if isinstance(value, str):
        if ext == "json":
            return field, value.encode()
        if ext in INT_EXTENSIONS:
            return field, int_text(value)
        return (field if ext in TEXT_EXTENSIONS else f"{field}.txt"), value.encode()
    raise ValueError(
        f"a {type(value).__name__} value has no encoding (see hpctrain convert --help)"
    )
