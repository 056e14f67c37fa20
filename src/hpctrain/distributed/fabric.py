"""Which network NCCL uses between nodes, against the fabric the cluster profile names.

NCCL falls back to TCP sockets when it cannot use InfiniBand (a container without the verbs
library or /dev/infiniband, `NCCL_IB_DISABLE=1` left in an environment, HCAs it was told not
to use): all-reduces then run several times slower (seen 4-7x in the wild, areal#639) and
nothing fails. The job script exports the profile's fabric (`HPCTRAIN_FABRIC=infiniband`);
on a multi-node GPU job the process group is made with NCCL's INIT/NET log in a file of the
rank's own, whose "Using network X" line names the network of its communicator. A mismatch
is one warning line naming what to set, or, with `slurm.require_fabric: true`, a launch error
before any training.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

from hpctrain.errors import LaunchFailure

FABRIC_ENV = "HPCTRAIN_FABRIC"
_USING = re.compile(r"NCCL INFO Using network (\S+)")
LOG_NAME = "nccl-init-%h-%p.log"  # NCCL fills in the host and the pid


class FabricError(LaunchFailure):
    """NCCL does not use the cluster's fabric and `slurm.require_fabric` is true."""


def nccl_log_env(environ: Mapping[str, str], folder: Path) -> dict[str, str]:
    """The variables that put NCCL's INIT/NET lines in `folder`; {} when the user set NCCL's
    logging already (their choice stands, and the check is off)."""
    if environ.get("NCCL_DEBUG") or environ.get("NCCL_DEBUG_FILE"):
        return {}
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": str(folder / LOG_NAME),
    }


def network_in_log(text: str) -> str | None:
    """The network NCCL's init log says a communicator uses (`IB`, `Socket`, a plugin's)."""
    found = _USING.findall(text)
    return found[-1] if found else None


def fabric_problem(expected: str, network: str | None) -> str | None:
    """The one line saying NCCL's network is not the fabric `expected`, or None."""
    if expected != "infiniband" or network is None or network != "Socket":
        return None
    return (
        "NCCL uses TCP sockets between nodes (its log: 'Using network Socket') though the "
        "cluster profile's fabric is infiniband: all-reduces run several times slower; set "
        "NCCL_IB_HCA to the node's InfiniBand devices (ibv_devinfo lists them), unset "
        "NCCL_IB_DISABLE, and in a container bind /dev/infiniband and the host's libibverbs"
    )


def check_fabric(folder: Path, expected: str, *, required: bool) -> str | None:
    """Read this process's NCCL init log in `folder` (then remove it) and compare.

    Returns the warning line (None when all is well or nothing was logged).

    Raises:
        FabricError: a mismatch and `required` (`slurm.require_fabric`).
    """
    text = ""
    for path in sorted(folder.glob("nccl-init-*.log")):
        try:
            text += path.read_text(errors="replace")
            path.unlink()
        except OSError:
            continue
    problem = fabric_problem(expected, network_in_log(text))
    if problem and required:
        raise FabricError(f"slurm.require_fabric=true: {problem}")
    return problem
