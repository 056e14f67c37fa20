"""How often the Trainer saves by time: `checkpoint.every_minutes`, a number or `auto`.

With `auto` the interval is Young's first-order optimum, sqrt(2 x C x M), for a blocking save
cost C (seconds, measured at every save) and the job's mean time between failures M (the
cluster profile's prior for one node, or the run's own failures: `FailureRate`, worked out by
`hpctrain.resilience.failure_rate` before training starts, divided by the nodes the job trains on).
Daly's higher-order estimate adds that when C >= M/2 the best interval is M itself.

- J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9),
  1974.
- J. T. Daly, "A higher order estimate of the optimum checkpoint interval for restart dumps",
  Future Generation Computer Systems 22(3), 2006.

Only failures SLURM does not announce matter here: a preemption or a time limit is signalled
and saved for (`train/preemption.py`), so it costs no work.

No torch here: the launch side builds `FailureRate` without importing the training stack.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("hpctrain")

# Before any save was measured (a new run), the first timed save comes this long into
# training: soon enough that little work is exposed before the cost is known, late enough that
# start-up transients (compilation, loader warm-up, the first allocations) are behind it, so
# the measured cost is the one later saves pay. A cost measured by an earlier process of the
# run (RUN_DIR/timeline.jsonl) is used from the start instead.
FIRST_INTERVAL_S = 300.0

# Without a profile to ask (a Trainer built directly, e.g. by a test or a benchmark): the
# generic profile's prior for one node (configs/clusters/generic.yaml says why).
DEFAULT_NODE_MTBF_HOURS = 12600.0


def young_daly_s(save_s: float, mtbf_s: float) -> float:
    """The checkpoint interval (s) that wastes the least time: sqrt(2 x C x M), or M when the
    save costs at least half the time between failures (Daly)."""
    assert save_s >= 0 and mtbf_s > 0, (save_s, mtbf_s)
    if save_s >= mtbf_s / 2:
        return mtbf_s
    return math.sqrt(2 * save_s * mtbf_s)


@dataclass(frozen=True)
class FailureRate:
    """How often one node fails under this run: the estimate and where it comes from.

    `node_mtbf_hours` = (prior + node-hours run) / (1 + failures): the profile's prior counts
    as one failure in `prior_node_hours`, so a run without failures keeps (and slowly raises)
    the prior, and the run's own failures take over as they accumulate.
    """

    node_mtbf_hours: float
    prior_node_hours: float  # the cluster profile's `mtbf_node_hours`
    failures: int = 0  # this run's failures that were not announced (attempts.jsonl)
    node_hours: float = 0.0  # node-hours this run's attempts trained (attempts.jsonl)
    source: str = "default"  # the profile that gave the prior

    @classmethod
    def estimate(
        cls, prior_node_hours: float, failures: int, node_hours: float, source: str
    ) -> FailureRate:
        return cls(
            node_mtbf_hours=(prior_node_hours + node_hours) / (1 + failures),
            prior_node_hours=prior_node_hours,
            failures=failures,
            node_hours=node_hours,
            source=source,
        )

    def with_exposure(self, node_hours: float) -> FailureRate:
        """The estimate once this many more node-hours ran without a failure."""
        return FailureRate.estimate(
            self.prior_node_hours, self.failures, self.node_hours + node_hours, self.source
        )

    def describe(self) -> str:
        return (
            f"{self.node_mtbf_hours:,.0f} node-hours between failures: prior "
            f"{self.prior_node_hours:,.0f} ({self.source}), this run {self.failures} failure(s) "
            f"in {self.node_hours:,.1f} node-hours"
        )


DEFAULT_FAILURE_RATE = FailureRate.estimate(DEFAULT_NODE_MTBF_HOURS, 0, 0.0, "built-in default")


class CheckpointInterval:
    """The seconds between timed saves, `None` when there are none.

    Args:
        every_minutes: `checkpoint.every_minutes`: minutes (0: no timed saves) or "auto".
        nodes: the nodes the job trains on (a job on N nodes fails N times as often as one).
        failure_rate: for "auto": one node's failure rate when the process started; the
            node-hours it runs without failing are added at each save.
        last_save_s: for "auto": a blocking save cost already measured (an earlier process).
    """

    def __init__(
        self,
        every_minutes: float | str,
        *,
        nodes: int = 1,
        failure_rate: FailureRate = DEFAULT_FAILURE_RATE,
        last_save_s: float | None = None,
    ) -> None:
        self.auto = every_minutes == "auto"
        self.nodes = max(1, nodes)
        self.failure_rate = self.initial_rate = failure_rate
        self.started = time.monotonic()
        self.save_s = last_save_s
        self.seconds: float | None
        if not self.auto:
            minutes = float(every_minutes)
            self.seconds = minutes * 60 if minutes else None
        elif last_save_s is None:
            self.seconds = FIRST_INTERVAL_S
        else:
            self.seconds = young_daly_s(last_save_s, self.mtbf_s)

    @property
    def mtbf_s(self) -> float:
        """The job's mean time between failures, in seconds."""
        return self.failure_rate.node_mtbf_hours * 3600 / self.nodes

    def inputs(self) -> dict[str, Any]:
        """What the interval was made of (the timeline's checkpoint record, the log line)."""
        if not self.auto:
            return {}
        return {
            "interval_s": self.seconds,
            "save_cost_s": self.save_s,
            "mtbf_s": self.mtbf_s,
            "nodes": self.nodes,
            "node_mtbf_hours": self.failure_rate.node_mtbf_hours,
            "failures": self.failure_rate.failures,
            "node_hours": self.failure_rate.node_hours,
            "prior_node_hours": self.failure_rate.prior_node_hours,
        }

    def describe(self) -> str:
        """One log line: the interval and its inputs."""
        assert self.auto and self.seconds is not None
        job = f"MTBF of {self.nodes} node(s): one node's {self.failure_rate.describe()}"
        if self.save_s is None:
            return (
                f"checkpoint.every_minutes=auto: first save after {self.seconds / 60:.1f} min "
                f"(no save measured yet); {job}"
            )
        return (
            f"checkpoint.every_minutes=auto: every {self.seconds / 60:.1f} min = Young/Daly "
            f"sqrt(2 x save {self.save_s:.2f} s x MTBF {self.mtbf_s:,.0f} s); {job}"
        )

    def after_save(self, blocking_s: float) -> None:
        """Re-evaluate with the cost the save just measured and the node-hours run since the
        process started, and log it."""
        if not self.auto:
            return
        running_h = (time.monotonic() - self.started) * self.nodes / 3600
        self.failure_rate = self.initial_rate.with_exposure(running_h)  # no failure so far
        self.save_s = blocking_s
        self.seconds = young_daly_s(blocking_s, self.mtbf_s)
        log.info("%s", self.describe())
