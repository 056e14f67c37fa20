"""Fixtures of the fault tests: the training tests' shards, and the SLURM tier's cluster."""

from tests.launch.conftest import slurm_cluster, tiny_shards
from tests.train.conftest import shapes_shards

__all__ = ["shapes_shards", "slurm_cluster", "tiny_shards"]
