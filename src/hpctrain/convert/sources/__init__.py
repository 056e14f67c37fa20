"""Where samples come from: one module per source kind, each with one lister.

| kind       | module         | SRC                                                        |
|------------|----------------|------------------------------------------------------------|
| `folder`   | `folder.py`    | an image folder, `SRC/<class>/<image>`                     |
| `images`   | `folder.py`    | a folder of images without labels (any depth)              |
| `manifest` | `manifest.py`  | a CSV/JSONL manifest, one row per sample                   |
| `shards`   | `shards.py`    | existing WebDataset shards (re-sharding)                   |
| `python`   | `generated.py` | `pkg.module:callable`, samples made by Python code         |
| `arrow`    | `arrow.py`     | Hugging Face `save_to_disk` folders, parquet/Arrow files   |

A lister turns SRC and the `ListOptions` into a `Source` (`base.py`: the records every kind
shares). A new source kind is one module with its lister and one line in `LISTERS` (and, when
it can be recognised from SRC, one test in `detect_kind`). Text sources (`text.py` here) are
not in the table: the token pipeline (`convert/text.py`) reads their documents, not samples.
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Callable

from hpctrain.convert.errors import ConvertError, ConvertOptionError
from hpctrain.convert.sources.arrow import list_arrow
from hpctrain.convert.sources.base import ListOptions, Source, fs_and_path
from hpctrain.convert.sources.folder import list_image_folder, list_images
from hpctrain.convert.sources.generated import is_python_spec, list_python
from hpctrain.convert.sources.manifest import list_manifest
from hpctrain.convert.sources.shards import list_shards
from hpctrain.data.index import INDEX_NAME, redact_url

Lister = Callable[[str, ListOptions], Source]

LISTERS: dict[str, Lister] = {
    "folder": list_image_folder,
    "images": list_images,
    "manifest": list_manifest,
    "shards": list_shards,
    "python": list_python,
    "arrow": list_arrow,
}
KINDS = tuple(LISTERS)


def list_source(src: str, kind: str = "auto", options: ListOptions | None = None) -> Source:
    """List the samples of `src` in source order (`kind` "auto": `detect_kind`)."""
    if kind == "auto":
        kind = detect_kind(src)
    if kind not in LISTERS:
        raise ConvertOptionError(f"unknown source kind {kind!r} ({', '.join(KINDS)})")
    return LISTERS[kind](src, options or ListOptions())


def detect_kind(src: str) -> str:
    """Guess the source kind from the URL and what is there."""
    lowered = src.lower().split("?", 1)[0]
    if lowered.endswith((".csv", ".jsonl", ".ndjson")):
        return "manifest"
    if lowered.endswith((".parquet", ".arrow")):
        return "arrow"
    if lowered.endswith(".tar") or "{" in src or lowered.endswith(INDEX_NAME):
        return "shards"
    if is_python_spec(src):
        return "python"
    fs, path = fs_and_path(src)
    if not fs.isdir(path):
        if fs.exists(path):
            raise ConvertError(
                f"{redact_url(src)}: not a folder, manifest (.csv/.jsonl), parquet/arrow file "
                "or shard (.tar)"
            )
        raise ConvertError(f"{redact_url(src)}: source not found")
    if fs.exists(posixpath.join(path, INDEX_NAME)):
        return "shards"
    if fs.exists(posixpath.join(path, "train", INDEX_NAME)):
        raise ConvertError(
            f"{redact_url(src)}: holds train/ and val/ shard sets; convert one: {redact_url(src)}/train"
        )
    entries = fs.ls(path, detail=True)
    names = {posixpath.basename(e["name"].rstrip("/")) for e in entries}
    if names & {"state.json", "dataset_dict.json"} or any(
        n.endswith((".arrow", ".parquet")) for n in names
    ):
        return "arrow"
    has_dirs = any(
        e["type"] == "directory" or (e.get("islink") and os.path.isdir(e["name"])) for e in entries
    )
    has_tars = any(e["name"].endswith(".tar") for e in entries)
    return "shards" if has_tars and not has_dirs else "folder"
