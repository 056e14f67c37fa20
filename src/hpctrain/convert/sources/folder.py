"""Image folders: `SRC/<class>/**/<image>`, one class per folder (as torchvision's ImageFolder),
and folders of images without labels (`--source images`: what `hpctrain predict` reads)."""

from __future__ import annotations

import os
import posixpath

from fsspec.implementations.local import LocalFileSystem

from hpctrain.convert.errors import ConvertError
from hpctrain.convert.sources.base import (
    ListOptions,
    SampleRef,
    Source,
    find_files,
    fs_and_path,
    full_url,
    sample_key,
)
from hpctrain.data.fieldnames import IMAGE_EXTENSIONS, last_extension
from hpctrain.data.index import redact_url


def list_image_folder(src: str, options: ListOptions | None = None) -> Source:
    """`src/<class>/**/<file>`: classes sorted by name give labels 0..C-1 (as torchvision's ImageFolder).

    Files are sorted by path within a class; hidden files (".name") and files directly in
    `src` are ignored. Files that are not images are kept here and rejected when read, so
    `--on-error` decides what happens to them. No `options` apply to image folders.
    """
    fs, root = fs_and_path(src)
    if not fs.isdir(root):
        raise ConvertError(f"{redact_url(src)}: source folder not found")
    root = root.rstrip("/")
    local = isinstance(fs, LocalFileSystem)
    class_dirs = sorted(
        posixpath.basename(e["name"].rstrip("/"))
        for e in fs.ls(root, detail=True)
        # a symlinked class folder (e.g. $SCRATCH -> $STORE) is a class folder
        if (e["type"] == "directory" or (local and e.get("islink") and os.path.isdir(e["name"])))
        and not posixpath.basename(e["name"].rstrip("/")).startswith(".")
    )
    if not class_dirs:
        raise ConvertError(f"{redact_url(src)}: no class folders (expected SRC/<class>/<image>)")
    samples: list[SampleRef] = []
    for label, name in enumerate(class_dirs):
        found = find_files(full_url(fs, posixpath.join(root, name)))
        for path in sorted(found):
            if posixpath.basename(path).startswith("."):
                continue
            samples.append(
                SampleRef(
                    key=sample_key(len(samples)),
                    url=full_url(fs, path),
                    size=found[path],
                    label=label,
                    source=posixpath.relpath(path, root),
                )
            )
    if not samples:
        raise ConvertError(f"{redact_url(src)}: no files under the class folders")
    return Source("folder", tuple(samples), tuple(class_dirs))


def list_images(src: str, options: ListOptions | None = None) -> Source:
    """Every image under `src` (any depth, sorted by path), without labels: new images to
    predict on. A file is an image by its extension (`.jpg`, `.png`, ...); other files and
    hidden ones (".name", or under a ".folder") are left out. No `options` apply.
    """
    fs, root = fs_and_path(src)
    if not fs.isdir(root):
        raise ConvertError(f"{redact_url(src)}: source folder not found")
    root = root.rstrip("/")
    found = find_files(full_url(fs, root))
    samples: list[SampleRef] = []
    for path in sorted(found):
        relative = posixpath.relpath(path, root)
        hidden = any(part.startswith(".") for part in relative.split("/"))
        if hidden or "." not in relative or last_extension(relative) not in IMAGE_EXTENSIONS:
            continue
        samples.append(
            SampleRef(
                key=sample_key(len(samples)),
                url=full_url(fs, path),
                size=found[path],
                source=relative,
            )
        )
    if not samples:
        extensions = ", ".join(sorted(IMAGE_EXTENSIONS))
        raise ConvertError(f"{redact_url(src)}: no image files ({extensions}) under it")
    return Source("images", tuple(samples))
