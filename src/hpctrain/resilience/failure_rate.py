"""How often a node fails under this run: the input of `checkpoint.every_minutes: auto`.

The cluster profile's `mtbf_node_hours` is the prior (configs/clusters/*.yaml say where each
figure comes from); the run's own history (`RUN_DIR/slurm/attempts.jsonl`) adds its failures
and the node-hours its attempts ran. The Trainer divides one node's estimate by the nodes it
trains on and turns it into an interval (`hpctrain.checkpoint.interval`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from hpctrain.checkpoint.interval import FailureRate
from hpctrain.resilience.records import read_records
from hpctrain.resilience.restart_policy import RETRYABLE, AttemptRecord

# Failures that ended training without warning and were not the user's: a rank killed, a
# distributed error, a hang, a lost node, an unexpected exit 1. A probe failure ended no
# training (no work lost), preemptions and time limits are announced (saved for), and user
# errors and bugs say nothing about the hardware.
FAILURE_KINDS = RETRYABLE - {"probe"}


def observed(records: Sequence[AttemptRecord]) -> tuple[int, float]:
    """(failures, node-hours) of a run's attempts.

    The exposure is every second an attempt ran on its nodes, start-up and saves included:
    a node fails whatever the job is doing on it.
    """
    failures, node_hours = 0, 0.0
    for record in records:
        if record.num_tasks and record.nodes:
            node_hours += max(0.0, record.end - record.start) * len(record.nodes) / 3600
            failures += record.kind in FAILURE_KINDS
    return failures, node_hours


def run_failure_rate(run_dir: Path, mtbf_node_hours: float, source: str) -> FailureRate:
    """One node's failure rate for the run in `run_dir`: the prior `mtbf_node_hours` (from
    `source`, a cluster profile) updated with the failures and node-hours of its attempts."""
    failures, node_hours = observed(read_records(run_dir))
    return FailureRate.estimate(mtbf_node_hours, failures, node_hours, source)
