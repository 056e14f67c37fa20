"""The trainer benchmark builds a Trainer in this process: restore the modes it switches on."""

from tests.train.conftest import _restore_torch_globals

__all__ = ["_restore_torch_globals"]
