import os
import sys

from hpctrain.cli.main import main

REQUEUE_EXIT_CODE = 75  # hpctrain.train.preemption's (not imported here: it imports torch)

code = main()
if code == REQUEUE_EXIT_CODE:
    # Saved for a requeue: leave now, without the interpreter's shutdown. Shutdown restores
    # the default signal handlers before it tears down modules (seconds with torch); the TERM
    # that `srun --kill-on-bad-exit=1` sends once another rank has exited 75 would kill this
    # rank there, srun would return 143 instead of 75 and the job would not be requeued.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
