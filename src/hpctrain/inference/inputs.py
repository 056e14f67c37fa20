"""What `hpctrain predict --data` may name besides shards: a plain folder of new images.

A local folder with no index (`index.json`, or the `train/` + `val/` of `convert
--val-fraction`) and no `.tar` files is read as images: converted to shards in a temporary
folder for this one prediction, as `hpctrain convert FOLDER -o SHARDS --source images` would
(every image at any depth, in path order, labels none, each sample's path under FOLDER kept
as its source, which the predictions carry), and removed afterwards. The conversion runs once,
in the command that starts the ranks (`--nproc N`: before they start); tasks started by
`srun` each run the command themselves, so there the folder is refused with the one line that
converts it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Iterator

from hpctrain.data.index import INDEX_NAME
from hpctrain.errors import UsageError

# The folder of images a `--nproc N` prediction's ranks read converted (they get `--data` the
# converted shards): what their manifest names as the data.
IMAGE_FOLDER_ENV = "HPCTRAIN_PREDICT_IMAGES"


def is_image_folder(data: str) -> bool:
    """Whether `data` is a local folder that holds no shards: images to convert first."""
    if "://" in data or not os.path.isdir(data):
        return False
    if os.path.exists(os.path.join(data, INDEX_NAME)):
        return False
    if os.path.exists(os.path.join(data, "train", INDEX_NAME)):
        return False
    return not any(name.endswith(".tar") for name in os.listdir(data))


def convert_hint(data: str) -> str:
    return f"hpctrain convert {data} -o SHARDS --source images"


def refuse_image_folder(data: str, why: str) -> None:
    """A UsageError naming the conversion to run first, where a folder cannot be converted
    here (the tasks of an `srun` step, a job submitted to SLURM)."""
    if is_image_folder(data):
        raise UsageError(
            f"--data {data}: a folder of images (no {INDEX_NAME}); {why}: convert it first "
            f"({convert_hint(data)}) and predict on SHARDS"
        )


@contextlib.contextmanager
def predict_data(data: str) -> Iterator[str]:
    """`data` as the loader reads it: itself, or for a folder of images (`is_image_folder`)
    shards converted from it into a temporary folder, removed when the block ends (and
    `IMAGE_FOLDER_ENV` naming the folder meanwhile, for the ranks this process starts).

    Raises:
        ConvertError: the folder holds no image file (a data error, exit 3).
    """
    if not is_image_folder(data):
        yield data
        return
    from hpctrain.convert.options import ConvertOptions
    from hpctrain.convert.run import convert

    with tempfile.TemporaryDirectory(prefix="hpctrain-predict-") as temporary:
        shards = os.path.join(temporary, "shards")
        result = convert(ConvertOptions(src=data, dest=shards, source_kind="images"))
        num_images = sum(index.num_samples for index in result.indexes.values())
        print(
            f"hpctrain predict: {num_images} images of {data} converted for this prediction "
            f"(to keep them as shards: {convert_hint(data)})",
            file=sys.stderr,
            flush=True,
        )
        os.environ[IMAGE_FOLDER_ENV] = data
        try:
            yield shards
        finally:
            del os.environ[IMAGE_FOLDER_ENV]


def data_name(data: str) -> str:
    """What a prediction's manifest names as its data: the folder of images the shards at
    `data` were converted from, when this is a rank of a prediction on one."""
    return os.environ.get(IMAGE_FOLDER_ENV, "") or data
