"""The errors a user can cause or fix, and the exit code of each kind.

The CLI prints an `HpctrainError` as one line (`hpctrain VERB: <label>: <message>`) and exits
with its kind's code; any other exception is a bug in hpctrain or in the user's code and keeps
its traceback. `hpctrain --debug VERB` (or HPCTRAIN_DEBUG=1, or `hpctrain train --debug`)
shows the traceback of every error. Each part keeps its own error
classes (`ShardReadError` in `data`, `CheckpointError` in `checkpoint`, ...); they derive from
one of the kinds below, so the CLI needs to know only these.

| exit code | kind                                                                   |
|-----------|------------------------------------------------------------------------|
| 1         | an unexpected error (a bug): printed with its traceback                |
| 2         | config or command line: a bad key, value, option, or argument path     |
| 3         | data: index, shards, manifest, samples (the data's own fault)          |
| 4         | checkpoint: missing, damaged, untrusted, or a failed save              |
| 5         | the run folder is locked by another run                                |
| 6         | launch: cluster profile, preflight, submission                         |
| 7         | distributed: a peer rank, the network or a collective failed (retried) |
| 8         | transient data fault: a loader worker died or stuck, an outage (retried)|
| 75        | not an error: saved after a preemption signal, requeue me (EX_TEMPFAIL)|
| 130       | interrupted (Ctrl-C); `train` saved the step first                    |
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

EXIT_BUG = 1
EXIT_CONFIG = 2
EXIT_DATA = 3
EXIT_CHECKPOINT = 4
EXIT_LOCKED = 5
EXIT_LAUNCH = 6
EXIT_DISTRIBUTED = 7
EXIT_TRANSIENT = 8


class HpctrainError(Exception):
    """An error with a one-line message naming the key, file or URL at fault."""

    exit_code = EXIT_BUG
    label = "error"


class UsageError(HpctrainError):
    """A bad command-line option or argument (a path that is not what the verb needs)."""

    exit_code = EXIT_CONFIG
    label = "usage error"


class DataError(HpctrainError):
    """Data that cannot be used: an index, a shard, a manifest, a loader worker."""

    exit_code = EXIT_DATA
    label = "data error"


class TransientDataError(DataError):
    """A data fault a new attempt can cure, not the data's own: a loader worker killed (the
    OOM killer's likeliest victim), a worker stuck on a hung file system (`data.timeout_s`),
    a shard still unreadable after its retries (an object store outage). The job script
    restarts the run (docs/clusters.md); a missing, forbidden or damaged index or shard stays
    a `DataError` (exit 3, the user's, never retried)."""

    exit_code = EXIT_TRANSIENT
    label = "data error (transient)"


class CheckpointFailure(HpctrainError):
    """A checkpoint that cannot be loaded or saved."""

    exit_code = EXIT_CHECKPOINT
    label = "checkpoint error"


class RunLockedError(HpctrainError):
    """Another run holds the run folder's lock (the message names its host, pid and job)."""

    exit_code = EXIT_LOCKED
    label = "run folder locked"


class LaunchFailure(HpctrainError):
    """A job that cannot be launched as configured."""

    exit_code = EXIT_LAUNCH
    label = "launch error"


class LaunchError(LaunchFailure, ValueError):
    """A job that cannot be submitted as configured; the message is one line."""


class DistributedError(HpctrainError):
    """A collective failed because of another rank or the network: a peer that died or hung,
    a connection reset, a timed-out collective. Not this rank's own fault: the job script
    restarts the run (docs/clusters.md), and the first rank that failed for its own reason
    is the one its attempt record names."""

    exit_code = EXIT_DISTRIBUTED
    label = "distributed error"


def rank_tag(environ: Mapping[str, str] | None = None) -> str:
    """` [rank R]` in a rank of a multi-process run, where every rank prints its own error.

    Ranks come from `train --nproc`/torchrun (RANK, WORLD_SIZE) or srun (SLURM_PROCID,
    SLURM_NTASKS), as in `hpctrain.distributed`.
    """
    env = os.environ if environ is None else environ
    for rank, size in (("RANK", "WORLD_SIZE"), ("SLURM_PROCID", "SLURM_NTASKS")):
        if env.get(size, "1") not in ("", "1") and rank in env:
            return f" [rank {env[rank]}]"
    return ""


def print_error_line(verb: str, exc: HpctrainError, *, tag: str = "") -> None:
    """`hpctrain VERB[ [rank R]]: <label>: <message>` on stderr, in one line and one write.

    One write keeps each rank's line whole where several ranks share one stderr: with
    PYTHONUNBUFFERED=1 (common on clusters), print() writes the text and its newline apart,
    and another rank's line can land between them.
    """
    message = " ".join(str(exc).splitlines())  # one line, even from a multi-line cause
    sys.stderr.write(f"hpctrain {verb}{tag}: {exc.label}: {message}\n")
    sys.stderr.flush()


def source_clone() -> Path | None:
    """The clone hpctrain runs from (an editable install of `CLONE/src/hpctrain`), or None
    for an installed package (site-packages)."""
    package = Path(__file__).resolve().parent
    root = package.parent.parent
    pyproject = root / "pyproject.toml"
    if package.parent.name != "src" or not pyproject.is_file():
        return None
    try:
        text = pyproject.read_text(errors="replace")
    except OSError:
        return None
    return root if 'name = "hpctrain"' in text else None


def install_hint(*extras: str) -> str:
    """The command that installs hpctrain's optional `extras` where hpctrain comes from: the
    clone it runs from (`pip install -e '.[text]'`, its path when run elsewhere), else the
    package index (`pip install 'hpctrain[text]'`). A hint naming the index to someone who
    works in a clone would fetch a second hpctrain over their own."""
    names = ",".join(extras)
    clone = source_clone()
    if clone is None:
        return f"pip install 'hpctrain[{names}]'"
    try:
        here = Path.cwd().resolve() == clone
    except OSError:  # the current folder was removed
        here = False
    return f"pip install -e '{'.' if here else clone}[{names}]'"
