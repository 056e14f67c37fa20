"""The class-name contract: a label means the class of that position in the training index.

Class names cross boundaries at every verb: the training index fixes them, the validation
data must agree (its label 1 is scored as the model's class 1), a checkpoint carries them
(`metadata.class_names`, so a model keeps its names when the data is re-converted), and the
export's model card repeats them. A mismatch names both lists.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from hpctrain.errors import DataError


class ClassNamesError(DataError):
    """Two places that must name the same classes do not (exit code 3)."""


def differ(first: Sequence[str], second: Sequence[str]) -> bool:
    """Whether two class lists disagree; an empty list (data without names) agrees with any."""
    return bool(first) and bool(second) and tuple(first) != tuple(second)


def mismatch(first: Sequence[str], first_where: str, second: Sequence[str], where: str) -> str:
    """One line naming both lists: `data.val names ['a', 'b'], data.train ['a', 'c']`."""
    return f"{where} names the classes {list(second)}, {first_where} {list(first)}"


def check_class_names(
    expected: Sequence[str], expected_where: str, actual: Sequence[str], where: str
) -> None:
    """Refuse data whose class names differ from the model's, naming both lists.

    Raises:
        ClassNamesError: both name classes, and not the same ones in the same order.
    """
    if differ(expected, actual):
        raise ClassNamesError(
            f"{mismatch(expected, expected_where, actual, where)}: its labels would be scored "
            "as other classes; convert it with the training data's classes"
        )


def checkpoint_class_names(manifest: dict[str, Any]) -> tuple[str, ...]:
    """The class names a checkpoint's manifest stores (empty for older checkpoints)."""
    names = (manifest.get("metadata") or {}).get("class_names") or ()
    return tuple(str(n) for n in names) if isinstance(names, list) else ()
