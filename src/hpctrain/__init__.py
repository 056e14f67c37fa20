"""hpctrain: train PyTorch models on SLURM clusters from WebDataset shards."""

from hpctrain import moved as _moved

__version__ = "0.1.0"

_moved.install()  # old module paths (hpctrain.train.task, hpctrain.dist, ...) still import
