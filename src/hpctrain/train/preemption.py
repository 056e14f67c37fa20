"""Preemption and time limits: a signal or a deadline sets a flag; ranks agree at a step boundary.

The signal handler only records the signal (checkpointing inside a handler can deadlock:
Lightning#21406); `PreemptionFlag.requested` is this rank's local view. The ranks agree in
the trainer (`Trainer.agree_on_flags` in `train/trainer.py`): at each step boundary one
all-reduce of every rank's `requested` makes all ranks take the same decision at the
same step, even when the signal reached only some of them. Then the trainer saves a
checkpoint with all ranks, arms `exit_on_signal`, and exits with `REQUEUE_EXIT_CODE`, which
the launchers read as "requeue me" (`launch/sbatch.py`, `launch/submit.py`).

The default signals are USR2 (submitit's and hpctrain's pre-timeout signal; USR1 clashes with
NCCL, Lightning#14610) and TERM (sent by SLURM at the time limit and on preemption). With
`deadline_margin_s` > 0 and `SLURM_JOB_END_TIME` set, the flag also rises that many seconds
before the job's end, even if no signal arrives.

Ctrl-C (SIGINT, unless `checkpoint.signals` names it) is a user's interrupt, not a preemption:
the ranks agree on it the same way and save the step, then the run exits with
`INTERRUPT_EXIT_CODE` (130, as a shell reports a process ended by SIGINT) and says to run the
same command to resume: nothing requeues it. A second Ctrl-C (during the save, or while an
evaluation finishes) ends the process at once: the checkpoint commit is atomic
(`checkpoint/commit.py`), so a save cut short leaves the newest committed step as it was.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from hpctrain.config import ConfigError

REQUEUE_EXIT_CODE = 75  # EX_TEMPFAIL: "try again later"
INTERRUPT_EXIT_CODE = 128 + signal.SIGINT  # 130: what a shell reports after Ctrl-C


def parse_signal(name: str) -> signal.Signals:
    """`USR2`, `SIGUSR2` or `12` → `signal.SIGUSR2` (a ConfigError naming checkpoint.signals)."""
    text = name.strip().upper()
    try:
        if text.isdigit():
            return signal.Signals(int(text))
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except (KeyError, ValueError):
        raise ConfigError(f"checkpoint.signals: unknown signal {name!r}") from None


def job_deadline(environ: Mapping[str, str], margin_s: float) -> float | None:
    """Unix time at which to stop: `SLURM_JOB_END_TIME - margin_s`, or None."""
    if margin_s <= 0:
        return None
    end = environ.get("SLURM_JOB_END_TIME", "")
    try:
        end_time = float(end)
    except ValueError:
        return None
    return end_time - margin_s if end_time > 0 else None


class PreemptionFlag:
    """Records preemption signals and the job deadline (ranks agree in `Trainer.agree_on_flags`).

    Args:
        signal_names: signals that request checkpoint-and-requeue (`checkpoint.signals`).
        deadline_margin_s: stop this long before `SLURM_JOB_END_TIME`; 0 disables.
        environ: environment to read `SLURM_JOB_END_TIME` from (default `os.environ`).
        clock: time source (Unix seconds), for tests.
        interrupt_line: written to stderr when a second Ctrl-C ends the process ("": none,
            e.g. on ranks other than 0, so that one line stands for the run).
    """

    def __init__(
        self,
        signal_names: Sequence[str] = ("USR2", "TERM"),
        deadline_margin_s: float = 0.0,
        *,
        environ: Mapping[str, str] | None = None,
        clock: Callable[[], float] = time.time,
        interrupt_line: str = "",
    ) -> None:
        self.signals = [parse_signal(n) for n in signal_names]
        # Ctrl-C: an interrupt of its own, unless the config made it a preemption signal
        self.interrupt_signals = [s for s in (signal.SIGINT,) if s not in self.signals]
        self._interrupt_line = interrupt_line.encode()
        self._interrupted = False
        self.deadline = job_deadline(os.environ if environ is None else environ, deadline_margin_s)
        self._clock = clock
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._exit_code: int | None = None

    def install(self) -> None:
        """Install the handlers (main thread only); `uninstall` restores the previous ones."""
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("PreemptionFlag.install() must run in the main thread")
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        for sig in self.interrupt_signals:
            self._previous[sig] = signal.signal(sig, self._handle_interrupt)

    def uninstall(self, *, keep_term: bool = False) -> None:
        """Restore the previous handlers, unless `exit_on_signal` armed them (kept to the end).

        `keep_term`: TERM stays noted (this handler, or one put there now) until the process
        exits: a failed rank of a job unwinds (loaders, process group) before it leaves with
        its exit code, and srun's TERM, sent once another rank has exited, must not kill it
        there (its end would read as stopped by SLURM instead of, say, a peer gone: exit 7).
        """
        if self._exit_code is not None:
            return
        main = threading.current_thread() is threading.main_thread()
        # ours stays installed (not restored), or one is put there now
        if keep_term and main and self._previous.pop(signal.SIGTERM, None) is None:
            signal.signal(signal.SIGTERM, self._handle)
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def exit_on_signal(self, code: int) -> None:
        """From now on, a signal ends the process at once with `code` (after the requeue save).

        The checkpoint is committed and the process is on its way out. Under
        `srun --kill-on-bad-exit=1` the first rank to exit with the requeue code makes srun
        send TERM to the ranks still tearing down; killed by it, they would make srun return
        143 instead of the requeue code, and the job would not be requeued.
        """
        self._exit_code = code
        if signal.SIGTERM not in self._previous:  # TERM is what srun and SLURM send
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self._exit_code is not None:
            os._exit(self._exit_code)
        # Only record: no I/O, no locks, no collectives in a signal handler. A second signal
        # (during the save) lands here too and changes nothing.
        if self._received is None:
            self._received = signal.Signals(signum)

    def _handle_interrupt(self, signum: int, frame: FrameType | None) -> None:
        if self._interrupted or self._exit_code is not None:
            # The second Ctrl-C: stop now, without Python's shutdown (no traceback, no
            # waiting for loader workers); os.write is safe in a handler, print is not.
            if self._interrupt_line:
                os.write(2, self._interrupt_line)
            os._exit(INTERRUPT_EXIT_CODE if self._exit_code is None else self._exit_code)
        self._interrupted = True

    @property
    def interrupted(self) -> bool:
        """This rank saw Ctrl-C (SIGINT not listed in `checkpoint.signals`)."""
        return self._interrupted

    @property
    def requested(self) -> bool:
        """This rank saw a signal, or the deadline has passed (local; no communication)."""
        return self._received is not None or (
            self.deadline is not None and self._clock() >= self.deadline
        )
