"""hpctrain: train PyTorch models on SLURM clusters from WebDataset shards."""

__version__ = "0.1.0"
