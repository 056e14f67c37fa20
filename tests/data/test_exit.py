"""A process holding loader workers at exit ends instead of hanging.

Workers ignore SIGTERM (SLURM signals every process of a step; the training process decides),
and multiprocessing stops daemonic children at exit with SIGTERM and then waits for them: a
loader still alive at exit (a module global, or in the traceback of a crash) hung the process
for ever; so did a multiprocessing child (a rank of mp.spawn) ending with a loader alive,
where atexit hooks do not run. Each case runs in its own interpreter; the timeout is a hang
detector, not a speed check.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from tests.support.loader_kit import make_shards

SCRIPT = textwrap.dedent(
    """
    import os, sys
    from hpctrain.config.schema import DataConfig
    from hpctrain.data import ShardedLoader, open_index

    mode, root = sys.argv[1], sys.argv[2]
    cfg = DataConfig(batch_size=2, workers_per_rank=2, shuffle_buffer=0,
                     persistent_workers=mode != "mid-epoch")
    loader = ShardedLoader(open_index(root), cfg, rank=0, world_size=1, seed=0)

    def run():
        batches = iter(loader)
        next(batches)  # workers running, the epoch unfinished
        if mode == "mid-epoch" or mode == "crash":
            raise RuntimeError("boom")
        for _ in batches:
            pass
        return batches

    if mode == "child":  # a loader alive at the end of a multiprocessing child (mp.spawn ranks)
        import multiprocessing

        def child():
            global held
            held = run()

        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(120)
        assert proc.exitcode == 0, proc.exitcode
        print("child exited", flush=True)
        sys.exit(0)
    held = run()
    pids = loader._pool.pids
    print("workers", *pids, flush=True)
    if mode == "close":
        loader.close()
        assert all(not os.path.exists(f"/proc/{p}") or
                   open(f"/proc/{p}/stat").read().split()[2] == "Z" for p in pids)
        print("closed", flush=True)
    """
)


@pytest.mark.parametrize(
    ("mode", "rc"),
    [("global", 0), ("crash", 1), ("mid-epoch", 1), ("close", 0), ("child", 0)],
)
@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_the_process_exits_with_its_workers(tmp_path, mode, rc):
    make_shards(tmp_path / "shards", [8, 8, 8])
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode, str(tmp_path / "shards")],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert proc.returncode == rc, proc.stderr[-2000:]
    if rc:
        assert "RuntimeError: boom" in proc.stderr
    if mode in ("close", "child"):
        assert ("closed" if mode == "close" else "child exited") in proc.stdout
