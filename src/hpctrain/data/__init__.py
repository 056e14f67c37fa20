"""Shard index, epoch plan and the per-rank streaming loader."""
