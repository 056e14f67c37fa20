"""Progress of a wait that may be long (an evaluation, a prediction, a generation): silent
while it is short, then a line every few seconds with the count, the rate and the time left.

The training loop has its step lines; what runs between them, or in `eval` and `predict`,
would otherwise leave a terminal (or a SLURM log) without a word for as long as it lasts: a
resnet50's final evaluation took 58 s on a 2-core CPU, `eval --nproc 2` 35 s. Only rank 0
speaks. No thread: the count is updated by the loop itself, so a line comes between two
items, never in the middle of one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("hpctrain")

# A wait shorter than this says nothing; a longer one says so this often.
QUIET_S = 10.0


def duration(seconds: float) -> str:
    """`0:42`, `1:02:03`."""
    seconds = int(max(0.0, seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Ticker:
    """Counts the items of a wait; after `quiet_s`, says `label: 120/400 batches (30%), 12.0
    batches/s, elapsed 0:10, ETA 0:23` every `quiet_s` (no total: no percentage, no ETA).

    Args:
        label: what is waited for (`evaluation of step 400`).
        total: items expected (0: unknown).
        unit: what is counted.
        enabled: False on ranks other than 0: counts, says nothing.
        quiet_s: seconds of silence before the first line, and between lines (default
            `QUIET_S`).
        clock, say: time source and where lines go (tests).
    """

    def __init__(
        self,
        label: str,
        total: int = 0,
        unit: str = "batches",
        *,
        enabled: bool = True,
        quiet_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ) -> None:
        self.label, self.total, self.unit = label, total, unit
        self.quiet_s = QUIET_S if quiet_s is None else quiet_s
        self.enabled, self.clock = enabled, clock
        self.say = say or (lambda line: log.info("%s", line))
        self.count = 0
        self.start = clock()
        self.next_line = self.start + self.quiet_s
        self.spoke = False

    def update(self, n: int = 1) -> None:
        self.count += n
        if not self.enabled:
            return
        now = self.clock()
        if now >= self.next_line:
            self.next_line = now + self.quiet_s
            self.spoke = True
            self.say(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.count / elapsed
        done = f"{self.count}/{self.total}" if self.total else str(self.count)
        share = f" ({100 * self.count / self.total:.0f}%)" if self.total else ""
        text = f"{self.label}: {done} {self.unit}{share}, {rate:.1f} {self.unit}/s"
        text += f", elapsed {duration(elapsed)}"
        if self.total and rate > 0:
            text += f", ETA {duration((self.total - self.count) / rate)}"
        return text
