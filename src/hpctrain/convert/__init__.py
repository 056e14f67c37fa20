"""Shards from sources: list, plan, write the tar shards, then the index; `hpctrain inspect`.

The contracts (shard format, index, a killed conversion) are in docs/architecture.md.
"""
