"""Worker processes for convert and inspect."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor


def process_pool(workers: int, *, preload_pil: bool = False) -> ProcessPoolExecutor:
    """A pool of `workers` processes, forked where the platform allows.

    Fork, not spawn: a spawned worker pays the interpreter start and the imports again, which
    ate most of the gain of `--workers 2` on small jobs. The one thread a convert process may
    run, fsspec's event loop (s3fs), is reset in children by fsspec's own at-fork hook, and its
    cached filesystem instances are dropped when the pid changes. Workers import no torch.
    """
    if preload_pil:
        from PIL import Image

        Image.preinit()  # import PIL and its common format plugins once, not once per worker
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    return ProcessPoolExecutor(max_workers=workers, mp_context=context)
