"""What a job does after one attempt of training: the pure decisions of `resilience/attempts.py`.

A job is a sequence of *attempts* inside its allocation (docs/clusters.md, "When a rank
dies"). After each one, `classify` reads how every rank ended (the records of
`resilience/watch.py`) and names the failure; `decide` turns that and the run's earlier attempts
into done, restart (in this allocation), requeue (through the queue) or stop; before each
attempt, `place` picks the nodes that passed the health probe (`resilience/probe.py`). No I/O
here: the job script's steps (`python -m hpctrain.resilience.attempts`) read the files, call
these functions and print their verdicts, and the tests drive them with made-up ranks.

How a rank's end is read:
- a rank killed by a signal SLURM does not send (SIGKILL from the OOM killer or `kill -9`,
  SIGSEGV, SIGBUS, SIGABRT...) died of its own: the first one is the failure and its node is
  suspect;
- an exit 2-6 is the user's (config, data, checkpoint, lock, launch: `hpctrain.errors`):
  never retried, whichever rank has it and whatever else happened (no new attempt cures
  it); an exit 1 (an unexpected error) is retried unless the previous attempt failed the
  same way at the same step (a bug);
- an exit 8 (`EXIT_TRANSIENT`: a loader worker killed or stuck, a shard unreadable after its
  retries) is a transient data fault: retried, no node blamed;
- an exit 7 (`EXIT_DISTRIBUTED`: a peer vanished, a collective timed out) is what the other
  ranks see when one fails: it is the failure only when nothing else is; when such ranks
  gave up while another never ended (it was still stuck when srun killed the step) that one
  hung, and its node is suspect;
- a rank its watcher ended for making no progress (`resilience/watch.py`: its heartbeat
  stopped for longer than its allowance) hung. Its peers, stuck in a collective waiting for
  it, stop beating too and are ended alike: the rank whose process was stopped is blamed,
  else the one that got least far (fewest beats), else the one whose progress stopped first;
- a rank without an end record died with its watcher. Its node went away (`lost`) unless
  something shows the node was there when srun ended the step: its watcher noted srun's TERM
  while the rank still ran, or srun reported how the task ended once it was ending the step
  (a task it reports killed before that died on its own); such a rank outlived the
  TERM and was killed with its watcher (`hang`). A node SLURM reports down or failed (the
  job script's `sinfo`, srun's "Node failure on" line) is named first: when every rank
  started and none ended, a healthy node whose rank srun killed is never the one blamed.
The earliest end wins among failures of one kind: the first rank to fail ends the step
(`srun --kill-on-bad-exit=1`), and every other rank's end follows from it.

What follows is bounded by progress and time, not by a count (docs/clusters.md): restarts go
on while attempts commit new checkpoints; `slurm.max_no_progress` attempts in a row without
one stop the run, and so does `slurm.max_failure_share` of the allocation lost to failures
when it is set. `slurm.max_restarts` bounds the restarts of one allocation only when set.
"""

from __future__ import annotations

import signal
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from hpctrain.errors import EXIT_BUG, EXIT_DISTRIBUTED, EXIT_TRANSIENT

REQUEUE_EXIT_CODE = 75  # hpctrain.train.preemption's (checked by a test; no torch import here)
USER_EXIT_CODES = frozenset(range(2, 7))  # config, data, checkpoint, locked, launch

# Signals SLURM itself sends the processes of a step: preemption and time-limit warnings
# (--signal, scancel --signal), the TERM of a cancel or of srun ending the step. A rank that
# dies of one of these was stopped, it did not fail.
SLURM_SIGNALS = frozenset(
    {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2,
     signal.SIGCONT, signal.SIGALRM}
)  # fmt: skip

Kind = Literal[
    "completed",  # every rank exited 0
    "preempted",  # the trainer saved and asked to be requeued (exit 75): preemption
    "time_limit",  # the same, near the job's end time
    "cancelled",  # the job is no longer running (scancel, SLURM's own requeue)
    "interrupted",  # the attempt never ended: the job shell was killed under it
    "user",  # exit 2-6: config, data, checkpoint, lock, launch; never retried
    "bug",  # exit 1 at the same step as the attempt before: never retried
    "error",  # exit 1 (or another unexpected code) at a new step
    "transient",  # exit 8: a loader worker killed or stuck, a shard unreadable after retries
    "signal",  # a rank killed by a signal SLURM does not send: OOM killer, kill -9, SIGSEGV
    "distributed",  # every failure is a distributed error: network, peer, collective timeout
    "hang",  # ranks gave up on a collective while one never ended
    "lost",  # ranks that never started or never ended, nothing else failed: a lost node
    "probe",  # too few nodes passed the health probe to train
]
Action = Literal["done", "restart", "requeue", "stop"]

# Failures hpctrain retries: not the user's (docs/clusters.md)
RETRYABLE: frozenset[str] = frozenset(
    {"error", "transient", "signal", "distributed", "hang", "lost", "probe"}
)
# Attempts that do not count against the run's progress: the scheduler ended them
NOT_COUNTED: frozenset[str] = frozenset({"preempted", "time_limit", "cancelled", "interrupted"})


@dataclass(frozen=True)
class RankEnd:
    """How one rank of an attempt ended (`resilience/watch.py` writes it, rank by rank)."""

    rank: int
    node: str
    started: float | None = None  # wall time; None: the rank never started
    ended: float | None = None  # None: no end record (died with its watcher)
    exit_code: int | None = None  # None when killed by a signal, or not ended
    signal: int | None = None  # the signal that killed it
    received: tuple[str, ...] = ()  # signals its watcher got before it ended (SIGTERM...)
    hung: bool = False  # its watcher ended it: no progress for longer than its allowance
    stopped: bool = False  # ... and the process was stopped (kill -STOP, frozen)
    beats: int | None = None  # heartbeats it made (ranks beat at the same points)
    last_progress: float | None = None  # wall time of its last heartbeat
    alive_at_term: bool = False  # still running when srun's TERM reached its node

    @property
    def failed(self) -> bool:
        return self.ended is not None and (self.signal is not None or self.exit_code != 0)

    @property
    def killed_by_itself(self) -> bool:
        """Killed by a signal SLURM does not send (its own fault, or the OOM killer's)."""
        return self.signal is not None and self.signal not in SLURM_SIGNALS

    def describe(self) -> str:
        """`rank 1 on n2 killed by SIGKILL`, `rank 0 on n1 exited 3`."""
        where = f"rank {self.rank} on {self.node}"
        if self.started is None:
            return f"{where} never started"
        if self.ended is None and self.alive_at_term:
            return f"{where} never ended (it outlived srun's TERM: hung, killed with its watcher)"
        if self.ended is None:
            return f"{where} never ended (its watcher went with it: its node was lost)"
        if self.hung:
            stopped = ", the process was stopped" if self.stopped else ""
            return f"{where} hung (no progress, ended by its watcher{stopped})"
        if self.signal is not None:
            return f"{where} killed by {signal_name(self.signal)}"
        return f"{where} exited {self.exit_code}"

    def summary(self) -> dict[str, Any]:
        """The `first_failure` of an attempt record."""
        return {
            "rank": self.rank,
            "node": self.node,
            "exit_code": self.exit_code,
            "signal": signal_name(self.signal) if self.signal is not None else None,
            "time": self.ended,
        }


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


@dataclass(frozen=True)
class Failure:
    """What an attempt's ranks say: the kind, and the rank that failed first (if any)."""

    kind: Kind
    culprit: RankEnd | None = None
    suspect_node: str = ""  # the node to blame: a rank killed by a signal, hung or lost
    time: float | None = None  # when it failed (a hang: its last progress); None: unknown
    detected: float | None = None  # when it was found (a hang: its watcher ended it)

    def summary(self) -> dict[str, Any] | None:
        """The `first_failure` of an attempt record (None without a culprit)."""
        if self.culprit is None:
            return None
        found = self.culprit.summary()
        found["time"] = self.time if self.time is not None else found["time"]
        found["detected"] = self.detected
        if self.culprit.hung:
            found["stopped"] = self.culprit.stopped
        return found


def _failed_at(kind: Kind, culprit: RankEnd, ranks: Sequence[RankEnd]) -> Failure:
    """`kind` blamed on `culprit`, with when it happened and when it was found."""
    if culprit.hung or (kind == "hang" and culprit.last_progress is not None):
        return Failure(kind, culprit, culprit.node, culprit.last_progress, culprit.ended)
    if culprit.ended is not None:
        return Failure(kind, culprit, culprit.node, culprit.ended, culprit.ended)
    # Gone without a word: the others' last progress tells when (peers stuck waiting for
    # it stopped beating then), else their first end (they noticed), else their start.
    others = [r for r in ranks if r is not culprit]
    progress = [r.last_progress for r in others if r.hung and r.last_progress is not None]
    ends = [r.ended for r in others if r.ended is not None]
    starts = [r.started for r in others if r.started is not None]
    known = progress or ends or starts
    return Failure(
        kind, culprit, culprit.node, min(known) if known else None, min(ends) if ends else None
    )


def _least_progress(hung: Sequence[RankEnd]) -> RankEnd:
    """Among ranks ended for no progress: a stopped process, else the one that got least
    far, else the one whose progress stopped first."""
    return min(
        hung,
        key=lambda r: (
            not r.stopped,
            r.beats if r.beats is not None else -1,
            r.last_progress if r.last_progress is not None else 0.0,
            r.rank,
        ),
    )


def classify(ranks: Sequence[RankEnd], *, srun_status: int, gone: Sequence[str] = ()) -> Failure:
    """The failure of one attempt from how its ranks ended (see the module docstring).

    `srun_status` is srun's own exit status: it decides only when no rank left a record.
    `gone`: nodes SLURM said went away during the attempt (down or failed after it; srun's
    "Node failure on" lines). Preemption, time limits and cancels are read by `decide`
    (they need the job's state).
    """
    ended = [r for r in ranks if r.ended is not None]
    if ranks and len(ended) == len(ranks) and not any(r.failed for r in ranks):
        return Failure("completed")
    failed = sorted((r for r in ended if r.failed), key=lambda r: (r.ended or 0.0, r.rank))
    hung = [r for r in failed if r.hung]
    failed = [r for r in failed if not r.hung]
    # A process seen stopped (kill -STOP, frozen) hung, however it ended after srun woke it
    stuck = hung + [r for r in failed if r.stopped and not r.killed_by_itself]
    if failed and not stuck and all(r.exit_code == REQUEUE_EXIT_CODE for r in failed):
        return _failed_at("preempted", failed[0], ranks)  # the ranks saved together
    own = [
        r
        for r in failed
        if r.signal is None and r.exit_code not in (EXIT_DISTRIBUTED, REQUEUE_EXIT_CODE)
    ]
    users = [r for r in own if r.exit_code in USER_EXIT_CODES]
    if users:  # before a signal too: srun's SIGKILL of a rank slow to leave after it
        culprit = _failed_at("user", users[0], ranks)
        return Failure("user", users[0], time=culprit.time, detected=culprit.detected)
    by_itself = [r for r in failed if r.killed_by_itself]
    if by_itself:
        return _failed_at("signal", by_itself[0], ranks)
    if own:
        first = own[0]
        kind: Kind = "transient" if first.exit_code == EXIT_TRANSIENT else "error"
        culprit = _failed_at(kind, first, ranks)
        return Failure(kind, first, time=culprit.time, detected=culprit.detected)
    never_started = [r for r in ranks if r.started is None]
    never_ended = [r for r in ranks if r.started is not None and r.ended is None]
    on_gone = [r for r in (*never_ended, *never_started) if r.node in gone]
    if on_gone:  # SLURM's own word: that node went away
        return _failed_at("lost", on_gone[0], ranks)
    vanished = [r for r in never_ended if not r.alive_at_term]
    if vanished:  # its watcher went without a word, and nothing says its node was there
        return _failed_at("lost", vanished[0], ranks)
    if stuck:
        return _failed_at("hang", _least_progress(stuck), ranks)
    if never_ended:  # outlived srun's TERM, killed with its watcher
        return _failed_at("hang", never_ended[0], ranks)
    if never_started and len(never_started) < len(ranks):  # a node whose tasks never ran
        return _failed_at("lost", never_started[0], ranks)
    if never_started:  # no rank started at all: srun could not start the step
        return Failure("lost")
    victims = [r for r in failed if r.exit_code == EXIT_DISTRIBUTED]
    if victims:
        culprit = _failed_at("distributed", victims[0], ranks)
        return Failure("distributed", victims[0], time=culprit.time, detected=culprit.detected)
    if failed:  # stopped by SLURM's signals only (before the trainer handled them)
        return _failed_at("preempted", failed[0], ranks)
    return Failure("error" if srun_status else "completed")


@dataclass(frozen=True)
class AttemptRecord:
    """One line of `RUN_DIR/slurm/attempts.jsonl`: one attempt, how it ended, what came next.

    The fields are documented in docs/clusters.md ("The attempts record"); later readers
    (goodput accounting, `checkpoint.every_minutes: auto`) rely on them: add, never rename.
    """

    attempt: int  # 1, 2, ... over the whole run folder (every job, requeue and restart)
    job_id: str
    restart: int  # SLURM_RESTART_COUNT: times this job was requeued before this attempt
    start: float  # wall time (s since the epoch) the attempt began, before the probe
    end: float  # wall time it was decided on
    nodes: list[str]  # the nodes it trained on ([] when the probe left too few)
    excluded: list[str]  # nodes of the allocation set aside when it began
    num_tasks: int  # ranks it ran (0 when it did not train)
    kind: str  # the failure's classification (`Kind`)
    decision: str  # done | restart | requeue | stop
    reason: str  # the one line the job log got
    first_failure: dict[str, Any] | None = None  # rank, node, exit_code, signal, time
    step_reached: int | None = None  # the highest step it logged (metrics.jsonl)
    resumed_from: int | None = None  # the newest committed step when it began
    committed: int | None = None  # the newest committed step when it ended
    set_aside: dict[str, str] = field(default_factory=dict)  # node → why (probe check, blame)
    srun_status: int | None = None  # srun's exit status (None: it did not train)
    exit_code: int = 0  # the job's exit status when it stopped here
    step_end: float | None = None  # `attempts end` began: srun had returned (None: no train)
    recovery: dict[str, Any] | None = None  # the restart before it, phase by phase (recovery.py)

    @property
    def progressed(self) -> bool:
        """A new checkpoint was committed during the attempt."""
        return self.committed is not None and (
            self.resumed_from is None or self.committed > self.resumed_from
        )

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> AttemptRecord:
        known = {f for f in cls.__dataclass_fields__}
        return cls(**{k: v for k, v in data.items() if k in known})


@dataclass(frozen=True)
class Policy:
    """The `slurm.*` keys the decisions follow."""

    nodes: int  # nodes an attempt trains on (slurm.nodes)
    max_restarts: int = 0  # restarts inside one allocation; 0: no count limit
    max_requeues: int = 3  # requeues of the job (SLURM_RESTART_COUNT)
    max_no_progress: int = 2  # attempts in a row without a new checkpoint; 0: no limit
    max_failure_share: float = 0.0  # of the allocation lost to failures; 0: no bound


@dataclass(frozen=True)
class Verdict:
    """What the job does next, and the one line the log gets."""

    action: Action
    kind: Kind
    line: str
    exit_code: int = 0  # the job's exit status when it stops (or requeues: 0)
    exclude: tuple[str, ...] = ()  # nodes set aside from the next attempt on
    culprit: RankEnd | None = None


def no_progress_run(history: Sequence[AttemptRecord]) -> int:
    """Attempts in a row, newest first, that committed no new checkpoint.

    Preemptions, time limits, cancels and interrupted attempts are skipped (they do not
    count against the run); one that committed a checkpoint ends the run of them.
    """
    count = 0
    for record in reversed(history):
        if record.progressed:
            break
        if record.kind in NOT_COUNTED:
            continue
        count += 1
    return count


def lost_seconds(
    start: float,
    end: float,
    *,
    kind: str,
    resumed_from: int | None,
    committed: int | None,
    step_reached: int | None,
) -> float:
    """Seconds of one attempt lost to its failure: all of it when it committed no new
    checkpoint, else the share of its steps past the newest commit (the next attempt trains
    them again). Attempts that did not fail (done, preempted, the user's) lose none here.
    An estimate from the attempts record alone; `status --goodput` measures it."""
    if kind not in RETRYABLE:
        return 0.0
    span = max(0.0, end - start)
    if committed is None or (resumed_from is not None and committed <= resumed_from):
        return span
    base = resumed_from or 0
    if step_reached is None or step_reached <= committed:
        return 0.0
    return span * (step_reached - committed) / max(1, step_reached - base)


def failure_seconds(records: Sequence[AttemptRecord]) -> float:
    """`lost_seconds` of these attempts together."""
    return sum(
        lost_seconds(
            r.start,
            r.end,
            kind=r.kind,
            resumed_from=r.resumed_from,
            committed=r.committed,
            step_reached=r.step_reached,
        )
        for r in records
    )


def _same_bug(culprit: RankEnd, step: int | None, history: Sequence[AttemptRecord]) -> bool:
    """The previous failed attempt also ended by an exit 1 at this step."""
    for record in reversed(history):
        if record.kind in NOT_COUNTED:
            continue
        before = record.first_failure or {}
        return (
            record.kind in ("error", "bug")
            and before.get("exit_code") == culprit.exit_code == EXIT_BUG
            and record.step_reached == step
            and step is not None
        )
    return False


def _suspect_again(node: str, history: Sequence[AttemptRecord]) -> bool:
    """The previous failed attempt blamed the same node."""
    for record in reversed(history):
        if record.kind in NOT_COUNTED or record.kind == "probe":
            continue
        before = record.first_failure or {}
        return record.kind in ("signal", "hang", "lost") and before.get("node") == node
    return False


def decide(
    failure: Failure,
    *,
    history: Sequence[AttemptRecord],
    policy: Policy,
    step_reached: int | None,
    committed_start: int | None,
    committed_end: int | None,
    restarts_here: int,
    requeues: int,
    job_running: bool,
    near_time_limit: bool = False,
    healthy_spares: int = 0,
    set_aside: Sequence[str] = (),
    failure_share: float = 0.0,
) -> Verdict:
    """Done, restart, requeue or stop after an attempt that ended as `failure` says.

    Args:
        history: the run's earlier attempts, oldest first (attempts.jsonl).
        step_reached: the highest step this attempt logged.
        committed_start, committed_end: the newest committed step before and after it.
        restarts_here: attempts this allocation already restarted.
        requeues: times the job was requeued (SLURM_RESTART_COUNT).
        job_running: SLURM still lists the job as RUNNING (not cancelled, not requeued).
        near_time_limit: the job's end time is within its signal margin.
        healthy_spares: nodes of the allocation beyond `policy.nodes` not set aside.
        set_aside: for a failed probe ("probe"): the nodes that failed it.
        failure_share: the share of this allocation lost to failures so far, this one
            included (`failure_seconds` over the allocation's length).
    """
    kind, culprit = failure.kind, failure.culprit
    if kind == "completed":
        return Verdict("done", kind, "training completed")
    if not job_running:
        return Verdict(
            "stop", "cancelled", "the job is no longer running (cancelled or requeued by SLURM)",
            exit_code=_exit_code(culprit), culprit=culprit,
        )  # fmt: skip
    if kind == "preempted":
        kind = "time_limit" if near_time_limit else "preempted"
        what = "time limit near" if near_time_limit else "preempted"
        if requeues >= policy.max_requeues:
            return Verdict(
                "stop", kind,
                f"checkpoint saved ({what}) but {policy.max_requeues} requeues done (slurm.max_requeues); resubmit to continue",
                exit_code=REQUEUE_EXIT_CODE, culprit=culprit,
            )  # fmt: skip
        return Verdict("requeue", kind, f"checkpoint saved ({what}); requeueing", culprit=culprit)
    if culprit is not None:
        cause = culprit.describe()
    elif kind == "probe" and set_aside:
        cause = f"too few nodes passed the health probe ({', '.join(set_aside)} failed)"
    elif kind == "probe":
        cause = "too few nodes left in the allocation"
    else:
        cause = "srun could not start the step"
    at_step = f" at step {step_reached}" if step_reached is not None else ""
    last = f"{cause}{at_step}"
    code = _exit_code(culprit)
    if kind == "user":
        return Verdict(
            "stop", kind, f"{last}: the user's error (exit 2-6: docs/errors.md), not retried",
            exit_code=code, culprit=culprit,
        )  # fmt: skip
    if kind == "error" and culprit is not None and _same_bug(culprit, step_reached, history):
        return Verdict(
            "stop", "bug", f"{last}, as the attempt before: a bug, not retried",
            exit_code=code, culprit=culprit,
        )  # fmt: skip
    progressed = committed_end is not None and (
        committed_start is None or committed_end > committed_start
    )
    stalled = 0 if progressed else 1 + no_progress_run(history)
    if policy.max_no_progress and stalled >= policy.max_no_progress:
        return Verdict(
            "stop", kind,
            f"stopped: no progress ({stalled} attempts in a row committed no checkpoint, slurm.max_no_progress={policy.max_no_progress}); last failure: {last}",
            exit_code=code, culprit=culprit,
        )  # fmt: skip
    if policy.max_failure_share and failure_share > policy.max_failure_share:
        return Verdict(
            "stop", kind,
            f"stopped: failures took {100 * failure_share:.0f} % of this allocation (slurm.max_failure_share={policy.max_failure_share:g}); last failure: {last}",
            exit_code=code, culprit=culprit,
        )  # fmt: skip
    exclude: tuple[str, ...] = tuple(set_aside)
    node = failure.suspect_node
    if node and (kind == "lost" or healthy_spares > 0 or _suspect_again(node, history)):
        exclude = (node,)  # set aside: a spare takes its place, or it failed twice running
    node = ", ".join(exclude)
    in_place = kind != "probe" and not (exclude and healthy_spares == 0)
    counted = policy.max_restarts > 0  # 0: restarts go on while attempts progress
    if in_place and (not counted or restarts_here < policy.max_restarts):
        aside = f"; {node} set aside" if exclude else ""
        count = (
            f"{restarts_here + 1}/{policy.max_restarts}, slurm.max_restarts"
            if counted
            else f"restart {restarts_here + 1}"
        )
        return Verdict(
            "restart", kind, f"{last}; restarting in this allocation ({count}){aside}",
            exclude=exclude, culprit=culprit,
        )  # fmt: skip
    if requeues < policy.max_requeues:
        if exclude:
            why = f"{node} set aside"
        elif kind == "probe":
            why = "for other nodes"
        else:
            why = f"{policy.max_restarts} restarts done here"
        return Verdict(
            "requeue", kind, f"{last}; requeueing ({why})", exclude=exclude, culprit=culprit
        )
    restarts = f"{policy.max_restarts} restarts and " if counted and in_place else ""
    keys = "slurm.max_restarts, slurm.max_requeues" if restarts else "slurm.max_requeues"
    return Verdict(
        "stop", kind,
        f"{last}; {restarts}{policy.max_requeues} requeues done ({keys})",
        exit_code=code, culprit=culprit,
    )  # fmt: skip


def _exit_code(culprit: RankEnd | None) -> int:
    """The job's exit status when it stops on this rank's failure (128 + N for a signal)."""
    if culprit is None:
        return EXIT_BUG
    if culprit.signal is not None:
        return 128 + culprit.signal
    return culprit.exit_code if culprit.exit_code else EXIT_BUG


__all__ = [
    "RETRYABLE",
    "AttemptRecord",
    "Failure",
    "Policy",
    "RankEnd",
    "Verdict",
    "classify",
    "decide",
    "failure_seconds",
    "lost_seconds",
    "no_progress_run",
]
