"""Rules that tie config keys together: pure functions of a `Config`, run when a config is
loaded (`load.load_config`: every verb, `hpctrain preflight` included, so a job is refused on
the login node) and by the trainer before any work (`load.check_rules`: configs built in code,
submitit's pickled ones). A key's own rules (type, range, choices) are `load.py`'s; rules
that need the device, the world size or the data are `parallel.precision.plan_training`'s
and the trainer's.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Mapping

from hpctrain.config.schema import Config


def broken_rule(cfg: Config, sources: Mapping[str, str] | None = None) -> str | None:
    """The one-line message of the first rule `cfg` breaks, naming its keys (and, with
    `sources`, where each came from: dotted key -> file or command line); None if none."""

    def named(key: str, value: object) -> str:
        where = (sources or {}).get(key)
        return f"{key}={value}" + (f" ({where})" if where else "")

    order = timeout_order(cfg, named)
    if order is not None:
        return order
    ema = cfg.train.ema_decay
    if ema >= 1 or (cfg.train.ema_eval and not ema):
        return (
            f"{named('train.ema_decay', ema)}: must be in (0, 1) (e.g. 0.999); "
            "0 disables the EMA (and then train.ema_eval must be false)"
        )
    tp, seq_len = cfg.train.tp_degree, cfg.data.seq_len
    if tp > 1 and seq_len % tp:
        # Sequence parallelism splits every sequence into tp equal parts along its length
        # (the norms' activations, `models/gpt.py` parallelize_tensors); a remainder aborted
        # the first step inside the collective (gloo: SIGABRT), after the queue wait.
        below = seq_len - seq_len % tp
        fits = f"{below} or {below + tp}" if below else f"{tp}"
        return (
            f"{named('data.seq_len', seq_len)}: {named('train.tp_degree', tp)} must divide it "
            f"(tensor parallelism splits every sequence into {tp} equal parts): use {fits}"
        )
    return None


# The timeouts from the finest to the coarsest (docs/clusters.md, "Timeouts"): each must fire
# before the next one would, so the one that knows most names the failure. A rank's watcher
# sees its heartbeat stop before its peers' collectives give up on it (the watcher names the
# hung rank; a collective timeout only says "a peer"); a collective times out before the
# step deadline ends a rank waiting in it; a step fits in a save's allowance; and a save fits
# in the lead SLURM's signal gives before the time limit.
TIMEOUTS = (
    ("train.heartbeat_timeout_s", "heartbeat"),
    ("train.collective_timeout_s", "collective"),
    ("train.step_timeout_s", "step"),
    ("checkpoint.save_timeout_s", "save"),
    ("slurm.signal_margin_s", "signal lead"),
)


def timeouts(cfg: Config) -> list[tuple[str, float]]:
    """The values of `TIMEOUTS` (0: off, or learnt from the run)."""
    values = (
        cfg.train.heartbeat_timeout_s,
        cfg.train.collective_timeout_s,
        cfg.train.step_timeout_s,
        cfg.checkpoint.save_timeout_s,
        float(cfg.slurm.signal_margin_s),
    )
    return [(key, float(value)) for (key, _), value in zip(TIMEOUTS, values, strict=True)]


def timeout_order(cfg: Config, named: Callable[[str, object], str]) -> str | None:
    """Each timeout that is set must be shorter than its neighbour above, when that is set
    too (one that is off or learnt breaks the chain there)."""
    chain = timeouts(cfg)
    for (low_key, low), (high_key, high) in itertools.pairwise(chain):
        if low and high and low >= high:
            keys = " < ".join(key for key, _ in TIMEOUTS)
            return (
                f"{named(low_key, f'{low:g}')} must be below {named(high_key, f'{high:g}')}: "
                f"the timeouts fire from the finest to the coarsest ({keys}; 0: off or learnt)"
            )
    return None


def describe_timeouts(cfg: Config) -> str:
    """The start-up line: the hierarchy as configured."""
    parts = []
    for (key, label), (_, value) in zip(TIMEOUTS, timeouts(cfg), strict=True):
        if key == "train.heartbeat_timeout_s" and value:
            text = f"max({value:g} s, {cfg.train.heartbeat_factor:g} x slowest recent step)"
        elif key == "checkpoint.save_timeout_s" and not value:
            text = "learnt" if cfg.train.heartbeat_timeout_s else "off"
        else:
            text = f"{value:g} s" if value else "off"
        parts.append(f"{label} {text}")
    return "timeouts: " + " < ".join(parts) + " (docs/clusters.md, timeouts)"
