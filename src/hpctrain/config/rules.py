"""Rules that tie config keys together: pure functions of a `Config`, run when a config is
loaded (`load.load_config`: every verb, `hpctrain preflight` included, so a job is refused on
the login node) and by the trainer before any work (`load.check_rules`: configs built in code,
submitit's pickled ones). A key's own rules (type, range, choices) are `load.py`'s; rules
that need the device, the world size or the data are `parallel.precision.plan_training`'s
and the trainer's.
"""

from __future__ import annotations

from collections.abc import Mapping

from hpctrain.config.schema import Config


def broken_rule(cfg: Config, sources: Mapping[str, str] | None = None) -> str | None:
    """The one-line message of the first rule `cfg` breaks, naming its keys (and, with
    `sources`, where each came from: dotted key -> file or command line); None if none."""

    def named(key: str, value: object) -> str:
        where = (sources or {}).get(key)
        return f"{key}={value}" + (f" ({where})" if where else "")

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
