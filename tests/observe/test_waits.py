"""Ticker: silent while a wait is short, then count, rate and ETA every few seconds."""

from __future__ import annotations

from hpctrain.observe.waits import Ticker, duration


def test_a_short_wait_says_nothing_and_a_long_one_says_count_rate_and_eta() -> None:
    now = [100.0]
    lines: list[str] = []
    ticker = Ticker("evaluation of step 400", 40, clock=lambda: now[0], say=lines.append)
    for _ in range(9):  # 9 batches in 9 s: under the quiet 10 s
        now[0] += 1.0
        ticker.update()
    assert lines == []
    now[0] += 1.0
    ticker.update()  # 10 of 40 after 10 s
    assert lines == [
        "evaluation of step 400: 10/40 batches (25%), 1.0 batches/s, elapsed 0:10, ETA 0:30"
    ]
    for _ in range(9):
        now[0] += 1.0
        ticker.update()
    assert len(lines) == 1  # the next line comes 10 s after the last
    now[0] += 1.0
    ticker.update()
    assert len(lines) == 2 and lines[1].startswith("evaluation of step 400: 20/40 batches (50%)")


def test_no_total_no_eta_and_other_ranks_stay_silent() -> None:
    now = [0.0]
    lines: list[str] = []
    ticker = Ticker("generation", clock=lambda: now[0], say=lines.append, unit="prompts")
    now[0] = 12.0
    ticker.update(6)
    assert lines == ["generation: 6 prompts, 0.5 prompts/s, elapsed 0:12"]
    quiet = Ticker("x", 5, enabled=False, clock=lambda: now[0], say=lines.append)
    now[0] = 100.0
    quiet.update()
    assert quiet.count == 1 and len(lines) == 1
    assert duration(3723) == "1:02:03" and duration(42) == "0:42"
