"""Running the trainer inside an Apptainer/Singularity image (`slurm.container`).

Many sites (Jean Zay among them) prefer a container image to a large virtual environment:
one `.sif` file instead of tens of thousands of files against the HOME/WORK file-count quotas.
The job script and submitit's command then run every task as
`<runtime> exec [--nv] --bind SRC ... IMAGE python3 -m hpctrain ...`. Apptainer mounts only
$HOME, the current folder and a few system paths by default, so the run folder, the data, the
checkpoints and the config must be bound: `container_binds` derives those from the config and
adds `slurm.container_binds`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hpctrain.config import Config

# The interpreter inside the image: images put their Python first on PATH as python3.
CONTAINER_PYTHON = "python3"


def local_folder(spec: str) -> str | None:
    """The local folder a data or checkpoint location lives in; None for URLs and `pipe:`."""
    if not spec or spec.startswith("pipe:"):
        return None
    if "://" in spec:
        if not spec.startswith("file://"):
            return None
        spec = spec[len("file://") :]
    if "{" in spec or spec.endswith((".json", ".tar")):
        spec = os.path.dirname(spec.split("{", 1)[0]) or "."
    if "$" not in spec and not os.path.isabs(spec):
        spec = os.path.abspath(spec)
    return spec.rstrip("/") or "/"


def container_binds(cfg: Config) -> tuple[str, ...]:
    """The run folder, log folder, data and checkpoint folders, then `slurm.container_binds`."""
    candidates = [
        local_folder(cfg.run_dir),
        local_folder(cfg.slurm.folder),
        *(local_folder(path) for _, path in cfg.data.train_paths()),
        local_folder(cfg.data.val),
        local_folder(cfg.checkpoint_root() if cfg.checkpoint.dir else ""),  # else in run_dir
        *cfg.slurm.container_binds,
    ]
    binds: list[str] = []
    for path in candidates:
        if path and path not in binds:
            binds.append(path)
    return tuple(binds)


def bind_source(bind: str) -> str:
    """SRC of a `SRC[:DEST[:OPTIONS]]` bind."""
    return bind.split(":", 1)[0]


def exec_words(
    runtime: str, image: str, binds: Sequence[str], *, gpus: bool, quote: bool = True
) -> list[str]:
    """`<runtime> exec [--nv] --bind B ... IMAGE python3` as words of a shell line.

    With `quote`, paths are wrapped in double quotes (checked by `check_path` before: they may
    hold `$SCRATCH`-style variables the job's shell expands); without, they are plain argv.
    """

    def q(path: str) -> str:
        return f'"{path}"' if quote else path

    words = [runtime, "exec"]
    if gpus:
        words.append("--nv")  # the host's NVIDIA driver libraries inside the image
    for bind in binds:
        words += ["--bind", q(bind)]
    words += [q(image), CONTAINER_PYTHON]
    return words
