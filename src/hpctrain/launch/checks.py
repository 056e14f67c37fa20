"""The result of one preflight check (shared by `preflight` and `environment`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    """One finding: `ok` False fails the preflight; a `warning` is reported but passes."""

    name: str
    ok: bool
    message: str
    warning: bool = False  # reported, but does not fail the preflight
