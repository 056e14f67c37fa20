"""The shard fixture of the training tests, for the fault tests."""

from tests.train.conftest import shapes_shards

__all__ = ["shapes_shards"]
