"""Rules between config keys, as one pure function of the config: the trainer runs it before
any work, `hpctrain preflight` (so `submit` and `sbatch`) on the login node, so that a job the
trainer would refuse is never queued. Rules that need the job's shape (ranks, nodes) are
`hpctrain.parallel.precision.plan_training`'s, which preflight runs with the job's shape.
"""

from __future__ import annotations

from hpctrain.config.load import ConfigError
from hpctrain.config.schema import Config


def check_rules(cfg: Config) -> None:
    """Refuse a combination of keys that cannot train, in one line naming the keys.

    Raises:
        ConfigError: `data.seq_len` that `train.tp_degree` does not divide (sequence
            parallelism splits each sequence over the tensor-parallel ranks; gloo aborts
            the process at the first step).
    """
    tp, seq_len = cfg.train.tp_degree, cfg.data.seq_len
    if tp > 1 and seq_len and seq_len % tp:
        raise ConfigError(
            f"data.seq_len={seq_len}: must be a multiple of train.tp_degree={tp} (sequence "
            "parallelism splits each sequence over the tensor-parallel ranks)"
        )
