"""Fixtures of the fault tests: the SLURM tier's cluster (the shards are session-wide, in
tests/support/shard_fixtures.py)."""

from tests.launch.conftest import slurm_cluster

__all__ = ["slurm_cluster"]
