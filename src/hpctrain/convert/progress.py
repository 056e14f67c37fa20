"""Progress reporting: a bar in a terminal, periodic plain lines in logs (SLURM output files)."""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class Progress:
    """Counts samples; shows a tqdm bar (`bar`), a line every `interval` seconds (`plain`) or nothing.

    Args:
        total: samples expected.
        mode: "auto" (bar when `stream` is a terminal, else plain), "bar", "plain" or "none".
        label: prefix of every line.
        interval: seconds between plain lines.
    """

    def __init__(
        self,
        total: int,
        mode: str = "auto",
        *,
        label: str = "convert",
        interval: float = 30.0,
        stream: TextIO | None = None,
    ) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode = mode
        self.total = total
        self.label = label
        self.interval = interval
        self.count = 0
        self.start = time.monotonic()
        self._last_line = self.start
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=label, unit="img", file=self.stream, smoothing=0.1)

    def update(self, n: int = 1) -> None:
        self.count += n
        if self._bar is not None:
            self._bar.update(n)
        elif self.mode == "plain":
            now = time.monotonic()
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._line(now)

    def _line(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.count / elapsed
        eta = (self.total - self.count) / rate if rate > 0 else 0.0
        percent = 100.0 * self.count / self.total if self.total else 100.0
        print(
            f"{self.label}: {self.count}/{self.total} samples ({percent:.0f}%), {rate:.0f} img/s, "
            f"elapsed {_duration(elapsed)}, ETA {_duration(eta)}",
            file=self.stream,
            flush=True,
        )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "plain":
            self._line(time.monotonic())
