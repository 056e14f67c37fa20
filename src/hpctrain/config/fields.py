"""The field helper of the config dataclasses (`schema.py`, `slurm_schema.py`)."""

from __future__ import annotations

from dataclasses import field
from typing import Any


def _f(default: Any, help: str, **checks: Any) -> Any:
    """A dataclass field with a default, a help line and optional checks."""
    if isinstance(default, (list, dict)):
        factory = default.copy
        return field(default_factory=factory, metadata={"help": help, **checks})
    return field(default=default, metadata={"help": help, **checks})
