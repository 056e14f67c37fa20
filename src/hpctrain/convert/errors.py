"""The errors of a conversion: bad data or a bad source (exit code 3), a bad option (2)."""

from __future__ import annotations

from hpctrain.errors import DataError, UsageError


class ConvertError(DataError, ValueError):
    """A user-facing conversion error (names the file or URL, never a credential)."""


class ConvertOptionError(ConvertError, UsageError):
    """A bad `hpctrain convert` option: a command-line mistake (exit code 2), not bad data."""

    exit_code = UsageError.exit_code
    label = UsageError.label


class ConvertedAlready(Exception):
    """DEST holds the finished output of the same command: nothing to do (not an error; the
    CLI says so and exits 0). Not a `ConvertError`: nothing is wrong."""
