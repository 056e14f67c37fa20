"""What a fork server's child runs in tests/resilience/test_forkserver.py:
`python -m tests.support.forkserver_child MODE [ARGS]`.

  report CODE   print what it runs with (one JSON line), a line on stderr, exit CODE
  signals       print "ready", then each of USR2 and TERM it gets; exit 0 after TERM
  sleep         print "ready" and sleep (until killed)
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    mode = argv[0]
    if mode == "report":
        mask = os.umask(0)
        print(json.dumps({
            "argv": sys.argv[1:], "pid": os.getpid(), "parent": os.getppid(),
            "cwd": os.getcwd(), "umask": mask, "cpus": sorted(os.sched_getaffinity(0)),
            "procid": os.environ.get("SLURM_PROCID"), "mine": os.environ.get("FORKSERVER_TEST"),
            "preloaded": "tests.support.forkserver_preloaded" in sys.modules,
            "pgid": os.getpgid(0),
        }), flush=True)  # fmt: skip
        print("a line on stderr", file=sys.stderr, flush=True)
        return int(argv[1])
    got: list[str] = []

    def note(signum: int, frame: object) -> None:
        got.append(signal.Signals(signum).name)
        print(f"got {signal.Signals(signum).name}", flush=True)

    for sig in (signal.SIGUSR2, signal.SIGTERM):
        signal.signal(sig, note)
    print("ready", flush=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and (mode == "sleep" or "SIGTERM" not in got):
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
