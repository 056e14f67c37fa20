"""A rank's progress, for its watcher: a 64-byte record in node-local shared memory.

Under a job script every rank runs as the child of a watcher (`resilience/watch.py`), which
names a node-local file in `HPCTRAIN_HEARTBEAT` (under /dev/shm). The trainer (`Progress`)
rewrites that record at each point of progress: a step begun, its batch ready, the step
done, an evaluation or a save begun and ended. The record holds the step, the phase, a
count of beats, when the last beat was (monotonic and wall clocks) and the *allowance*: how
long the rank may go without the next beat before its watcher ends it as hung. No
collective, no system call: one `struct.pack_into` into a memory map (about a microsecond:
`hpctrain bench attempts` measures it), so it runs every step.

The allowance is learnt from the run (as nvidia-resiliency-ext's fault tolerance learns
its section timeouts from observed ones), per phase:

- start-up (imports, process group, index, model, checkpoint load) and the first step of
  the process (it compiles, autotunes, starts the loader and NCCL): `train.first_step_timeout_s`
  (0: not watched);
- a step: max(`train.heartbeat_timeout_s`, `train.heartbeat_factor` x the slowest of the
  recent steps of this process); before a second step was measured, the first one stands in;
  a step in which the loader starts an epoch (its workers may start again): at least
  `train.heartbeat_factor` x the process's first step, which started the loader too (a
  step that starts the first epoch of the process is its first step: as above). Not the
  first step's own allowance: a rank stopped at an epoch's start would hold every node for
  `train.first_step_timeout_s` (30 min), as the chaos run found;
- an evaluation: the first of the process as the first step, then max(floor, factor x the
  slowest evaluation so far);
- a save: `checkpoint.save_timeout_s` when set, else max(floor, factor x the slowest save
  measured, in this process or, before its first, the run's last recorded one), else the
  first step's allowance;
- the end (final save done, tearing down): not watched.

The watcher's reader (`read_beat`) accepts a record only when its sequence number is the
same at both ends (the writer is not in the middle of it). Without `HPCTRAIN_HEARTBEAT`
(a local run) `Progress` does nothing. Stdlib only: the watcher reads it without torch.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

HEARTBEAT_ENV = "HPCTRAIN_HEARTBEAT"
# seq, step, phase, beats, monotonic, wall, allowance_s, dumps, dump_signal, seq again
LAYOUT = struct.Struct("<QqiIdddIiQ")
SIZE = LAYOUT.size  # 64
PHASES = ("none", "startup", "first step", "step", "eval", "save", "ending")
RECENT_STEPS = 1000  # "the slowest recent step": the last this many steps of the process


@dataclass(frozen=True)
class Beat:
    """The last progress a rank recorded."""

    step: int
    phase: str
    beats: int  # beats since the process started: ranks beat at the same points
    monotonic: float  # time.monotonic() of the beat (one clock for the whole node)
    wall: float  # time.time() of the beat
    allowance_s: float  # how long the next beat may take; 0: not watched
    dumps: int  # stack dumps the rank has written (on `dump_signal`)
    dump_signal: int  # the signal that makes it dump its stacks; 0: none now


def read_beat(path: str | Path) -> Beat | None:
    """The record at `path`, or None (not written yet, or being written: read again)."""
    try:
        with open(path, "rb") as f:
            data = f.read(SIZE)
    except OSError:
        return None
    if len(data) < SIZE:
        return None
    seq, step, phase, beats, mono, wall, allowance, dumps, dump_signal, seq2 = LAYOUT.unpack(data)
    if seq == 0 or seq != seq2:
        return None
    name = PHASES[phase] if 0 <= phase < len(PHASES) else "none"
    return Beat(step, name, beats, mono, wall, allowance, dumps, dump_signal)


class Progress:
    """The trainer's side: beats into the watcher's record, with the learnt allowances.

    Args:
        path: the record (`HPCTRAIN_HEARTBEAT`); None: every method does nothing.
        floor_s: `train.heartbeat_timeout_s`, the least allowance of a step (0: steps,
            evaluations and saves are not watched).
        factor: `train.heartbeat_factor`, the allowance over the slowest recent one.
        first_s: `train.first_step_timeout_s`, start-up and the first step (0: not watched).
        save_s: `checkpoint.save_timeout_s` (0: learnt).
        prior_save_s: the run's last recorded save, before this process measured one.
    """

    def __init__(
        self,
        path: str | Path | None,
        *,
        floor_s: float = 30.0,
        factor: float = 5.0,
        first_s: float = 1800.0,
        save_s: float = 0.0,
        prior_save_s: float | None = None,
    ) -> None:
        self.floor_s, self.factor, self.first_s = floor_s, factor, first_s
        self.save_s, self.prior_save_s = save_s, prior_save_s
        self.steps = SlowestRecent(RECENT_STEPS)
        self.first_step_s: float | None = None
        self.evals: list[float] = []
        self.saves: list[float] = []
        self.seq = self.beats = self.dumps = self.dump_signal = 0
        self.step_no, self.phase_no, self.allowance = 0, 0, 0.0
        self._next_step, self._step_start = 0, 0.0
        self._map: mmap.mmap | None = None
        if path:
            self._map = _open_map(Path(path))

    @classmethod
    def from_environ(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        floor_s: float = 30.0,
        factor: float = 5.0,
        first_s: float = 1800.0,
        save_s: float = 0.0,
        prior_save_s: float | None = None,
    ) -> Progress:
        """The record the watcher named, if any (`HEARTBEAT_ENV`)."""
        env = os.environ if environ is None else environ
        return cls(
            env.get(HEARTBEAT_ENV) or None, floor_s=floor_s, factor=factor, first_s=first_s,
            save_s=save_s, prior_save_s=prior_save_s,
        )  # fmt: skip

    @property
    def active(self) -> bool:
        return self._map is not None

    # ------------------------------------------------------------ allowances
    def step_allowance(self) -> float:
        if not self.floor_s:
            return 0.0
        slowest = self.steps.slowest if self.steps.slowest is not None else self.first_step_s
        if slowest is None:
            return self.first_s
        return max(self.floor_s, self.factor * slowest)

    def eval_allowance(self) -> float:
        if not self.floor_s:
            return 0.0
        if not self.evals:
            return self.first_s
        return max(self.floor_s, self.factor * max(self.evals))

    def save_allowance(self) -> float:
        if self.save_s:
            return self.save_s
        if not self.floor_s:
            return 0.0
        measured = max(self.saves) if self.saves else self.prior_save_s
        if measured is None:
            return self.first_s
        return max(self.floor_s, self.factor * measured)

    # ------------------------------------------------------------ the trainer's hooks
    def starting(self, step: int = 0) -> None:
        """Start-up: before the first step of the process."""
        self._beat(step, 1, self.first_s)

    def step(self, number: int) -> Progress:
        """`with progress.step(n):` around training step n: begun, then done (its time
        learnt). A plain context manager, not a generator's: this runs every step."""
        self._next_step = number
        return self

    def __enter__(self) -> Progress:
        if self._map is not None:  # no watcher: nothing to learn for
            first = self.first_step_s is None
            allowance = self.first_s if first else self.step_allowance()
            self._beat(self._next_step, 2 if first else 3, allowance)
            self._step_start = time.monotonic()
        return self

    def __exit__(self, kind: object, *rest: object) -> None:
        if self._map is None or kind is not None:
            return
        took = time.monotonic() - self._step_start
        if self.first_step_s is None:
            self.first_step_s = took
        else:
            self.steps.add(took)
        self._beat(self._next_step, 3, self.step_allowance())

    def loading(self) -> None:
        """The loader starts an epoch (its workers, its first shards): this step may take as
        long as the process's first step, which started the loader too, and then some."""
        if self.allowance:
            learnt = self.first_s if self.first_step_s is None else self.factor * self.first_step_s
            self._beat(self.step_no, self.phase_no, max(self.allowance, learnt))

    def data_ready(self) -> None:
        """The step's batches are here (a rank stuck in its loader beats no further)."""
        self._beat(self.step_no, self.phase_no, self.allowance)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Around an evaluation ("eval") or a save ("save") at a step boundary."""
        if self._map is None:
            yield
            return
        allowance = self.eval_allowance() if name == "eval" else self.save_allowance()
        step = self.step_no
        self._beat(step, PHASES.index(name), allowance)
        start = time.monotonic()
        yield
        (self.evals if name == "eval" else self.saves).append(time.monotonic() - start)
        self._beat(step, 3, self.step_allowance())

    def ending(self) -> None:
        """Training is over (or failed): the rest is not watched."""
        self._beat(self.step_no, 6, 0.0)

    def arm_dumps(self, signum: int) -> None:
        """The rank now writes its stacks on `signum` (0: no longer)."""
        self.dump_signal = signum
        self._beat(self.step_no, self.phase_no, self.allowance, count=False)

    def dumped(self) -> None:
        """A stack dump is written (the watcher waits for it before it kills)."""
        self.dumps += 1
        self._beat(self.step_no, self.phase_no, self.allowance, count=False)

    def _beat(self, step: int, phase: int, allowance: float, *, count: bool = True) -> None:
        self.step_no, self.phase_no, self.allowance = step, phase, allowance
        if self._map is None:
            return
        self.seq += 1
        self.beats += count
        LAYOUT.pack_into(
            self._map, 0, self.seq, step, phase, self.beats, time.monotonic(), time.time(),
            allowance, self.dumps, self.dump_signal, self.seq,
        )  # fmt: skip

    def describe(self) -> str:
        """The step allowance's rule, for the start-up line."""
        if not self.floor_s:
            return "heartbeat off"
        return f"heartbeat max({self.floor_s:g} s, {self.factor:g} x slowest recent step)"


class SlowestRecent:
    """The largest of the last `size` values, in constant time per value (a deque of the
    values that may still become the largest, decreasing: the sliding-window maximum)."""

    def __init__(self, size: int) -> None:
        self.size, self.count = size, 0
        self._window: collections.deque[tuple[int, float]] = collections.deque()

    def add(self, value: float) -> None:
        while self._window and self._window[-1][1] <= value:
            self._window.pop()
        self._window.append((self.count, value))
        self.count += 1
        if self._window[0][0] <= self.count - 1 - self.size:
            self._window.popleft()

    def extend(self, values: Iterable[float]) -> None:
        for value in values:
            self.add(value)

    @property
    def slowest(self) -> float | None:
        return self._window[0][1] if self._window else None


def _open_map(path: Path) -> mmap.mmap | None:
    """The record's memory map (the watcher made the file); None where it cannot be opened."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < SIZE:
            os.ftruncate(fd, SIZE)
        return mmap.mmap(fd, SIZE)
    except OSError:
        return None
    finally:
        os.close(fd)


__all__ = ["HEARTBEAT_ENV", "Beat", "Progress", "read_beat"]
