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
    """Counts items; shows a tqdm bar (`bar`), a line every `interval` seconds (`plain`) or nothing.

    Args:
        total: items expected (0: not known; the lines show no percentage and no ETA).
        mode: "auto" (bar when `stream` is a terminal, else plain), "bar", "plain" or "none".
        label: prefix of every line.
        interval: seconds between plain lines.
        unit: what is counted (`samples`, `documents`), and `rate_unit` its rate.
        count_tokens: also count tokens (`update(n, tokens=...)`) and show their rate.
    """

    def __init__(
        self,
        total: int,
        mode: str = "auto",
        *,
        label: str = "convert",
        interval: float = 30.0,
        stream: TextIO | None = None,
        unit: str = "samples",
        rate_unit: str = "img/s",
        count_tokens: bool = False,
    ) -> None:
        self.stream = stream or sys.stderr
        if mode == "auto":
            mode = "bar" if self.stream.isatty() else "plain"
        self.mode = mode
        self.total = total
        self.label = label
        self.interval = interval
        self.unit = unit
        self.rate_unit = rate_unit
        self.count_tokens = count_tokens
        self.count = 0
        self.tokens = 0
        self.start = time.monotonic()
        self._last_line = self.start
        self._bar: Any = None
        if mode == "bar":
            from tqdm import tqdm

            self._bar = tqdm(
                total=total or None,
                desc=label,
                unit=rate_unit.removesuffix("/s"),
                file=self.stream,
                smoothing=0.1,
            )

    def update(self, n: int = 1, tokens: int = 0) -> None:
        self.count += n
        self.tokens += tokens
        if self._bar is not None:
            self._bar.update(n)
            if self.count_tokens:
                self._bar.set_postfix_str(f"{self.tokens} tokens", refresh=False)
        elif self.mode == "plain":
            now = time.monotonic()
            if now - self._last_line >= self.interval:
                self._last_line = now
                self._line(now)

    def _line(self, now: float) -> None:
        elapsed = max(now - self.start, 1e-9)
        rate = self.count / elapsed
        line = f"{self.label}: {self.count}"
        if self.total:
            percent = 100.0 * self.count / self.total
            line += f"/{self.total} {self.unit} ({percent:.0f}%)"
        else:
            line += f" {self.unit}"
        line += f", {rate:.0f} {self.rate_unit}"
        if self.count_tokens:
            line += f", {self.tokens} tokens ({self.tokens / elapsed:.0f} tokens/s)"
        line += f", elapsed {_duration(elapsed)}"
        if self.total:
            eta = (self.total - self.count) / rate if rate > 0 else 0.0
            line += f", ETA {_duration(eta)}"
        print(line, file=self.stream, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.mode == "plain":
            self._line(time.monotonic())
