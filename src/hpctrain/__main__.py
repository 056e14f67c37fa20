import contextlib
import os
import sys

from hpctrain.cli.main import main

code = main()
if code != 0:
    # Saved for a requeue, or a one-line error: leave now, without the interpreter's
    # shutdown. Shutdown restores the default signal handlers before it tears down modules
    # (seconds with torch); the TERM that `srun --kill-on-bad-exit=1` sends once another rank
    # has exited (75, or the same error's code) would kill this rank there: srun would return
    # 143 instead of 75 and the job would not be requeued, or sacct show 15 for a data error.
    with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
