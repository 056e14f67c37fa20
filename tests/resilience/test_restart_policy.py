"""The decisions after an attempt (resilience/restart_policy.py), from made-up rank ends.

No processes: each case writes how the ranks of an attempt ended, as the watchers would, and
checks the failure named and what the job does next.
"""

from __future__ import annotations

import dataclasses
import signal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.resilience.placement import ProbeResult, place
from hpctrain.resilience.restart_policy import (
    REQUEUE_EXIT_CODE,
    RETRYABLE,
    AttemptRecord,
    Failure,
    Policy,
    RankEnd,
    classify,
    decide,
    lost_seconds,
    no_progress_run,
)

KILL, TERM, SEGV = int(signal.SIGKILL), int(signal.SIGTERM), int(signal.SIGSEGV)
POLICY = Policy(nodes=2, max_restarts=3, max_requeues=3, max_no_progress=2)


def ended(rank: int, at: float, *, code: int | None = None, sig: int | None = None,
          node: str = "") -> RankEnd:  # fmt: skip
    return RankEnd(rank, node or f"n{rank // 2 + 1}", started=0.0, ended=at,
                   exit_code=code, signal=sig)  # fmt: skip


def record(kind: str, *, committed: int | None = 10, resumed: int | None = 10,
           step: int | None = 12, code: int | None = 1, node: str = "n1",
           job: str = "7", restart: int = 0, decision: str = "restart") -> AttemptRecord:  # fmt: skip
    return AttemptRecord(
        attempt=1, job_id=job, restart=restart, start=0.0, end=1.0, nodes=["n1", "n2"],
        excluded=[], num_tasks=4, kind=kind, decision=decision, reason="",
        first_failure={"rank": 0, "node": node, "exit_code": code, "signal": None},
        step_reached=step, resumed_from=resumed, committed=committed,
    )  # fmt: skip


def verdict(failure: Failure, history=(), **facts):  # type: ignore[no-untyped-def]
    args = {
        "history": list(history), "policy": POLICY, "step_reached": 12, "committed_start": 10,
        "committed_end": 10, "restarts_here": 0, "requeues": 0, "job_running": True,
        "near_time_limit": False, "healthy_spares": 0,
    }  # fmt: skip
    args.update(facts)
    return decide(failure, **args)


# ------------------------------------------------------------------------------ classify
def test_a_rank_killed_by_sigkill_is_the_failure_not_the_peers_that_lost_it() -> None:
    ranks = [ended(0, 10.2, code=7), ended(1, 10.0, sig=KILL), ended(2, 10.3, sig=TERM),
             ended(3, 10.1, code=1)]  # fmt: skip
    failure = classify(ranks, srun_status=143)
    assert failure.kind == "signal" and failure.culprit is not None
    assert (failure.culprit.rank, failure.suspect_node) == (1, "n1")
    assert failure.culprit.describe() == "rank 1 on n1 killed by SIGKILL"


def test_the_earliest_own_failure_wins_and_exit_2_to_6_is_the_users() -> None:
    ranks = [ended(0, 5.0, code=3), ended(1, 4.0, code=3), ended(2, 6.0, code=7)]
    failure = classify(ranks, srun_status=3)
    assert failure.kind == "user" and failure.culprit is not None and failure.culprit.rank == 1
    assert classify([ended(0, 1.0, code=1), ended(1, 2.0, code=7)], srun_status=1).kind == "error"


def test_peers_that_gave_up_while_one_outlived_sruns_term_point_at_the_hung_rank() -> None:
    # its watcher saw srun's TERM while it ran; then srun's KILL took both
    hung = RankEnd(3, "n2", started=0.0, alive_at_term=True)
    failure = classify([ended(0, 9.0, code=7), ended(1, 9.1, code=7), ended(2, 9.0, code=7), hung],
                       srun_status=7)  # fmt: skip
    assert (failure.kind, failure.suspect_node) == ("hang", "n2")
    assert failure.culprit == hung
    assert hung.describe() == (
        "rank 3 on n2 never ended (it outlived srun's TERM: hung, killed with its watcher)"
    )


def test_a_peer_that_went_away_is_lost_whether_the_survivor_exited_7_or_died_of_term() -> None:
    """The same injection (n2's watcher, rank and slurmd killed) was `hang` in one run and
    `lost` in another (#47): the survivor saw gloo's "connection closed" and exited 7, or
    srun's TERM killed it while it unwound. A rank whose watcher went without a word, and
    whose node nothing shows was there, is a lost node either way."""
    gone = [RankEnd(2, "n2", started=0.0), RankEnd(3, "n2", started=0.0)]
    for survivors in ([ended(0, 9.0, code=7), ended(1, 9.1, code=7)],
                      [ended(0, 9.0, sig=TERM), ended(1, 9.1, sig=TERM)]):  # fmt: skip
        failure = classify([*survivors, *gone], srun_status=1)
        assert (failure.kind, failure.culprit, failure.suspect_node) == ("lost", gone[0], "n2")
        assert verdict(failure).exclude == ("n2",)  # a lost node is always set aside
    assert (
        gone[0].describe()
        == "rank 2 on n2 never ended (its watcher went with it: its node was lost)"
    )


def stuck(rank: int, at: float, *, beats: int, last: float, stopped: bool = False,
          node: str = "") -> RankEnd:  # fmt: skip
    """A rank its watcher ended for making no progress (killed after its stacks)."""
    return RankEnd(rank, node or f"n{rank // 2 + 1}", started=0.0, ended=at, signal=KILL,
                   hung=True, stopped=stopped, beats=beats, last_progress=last)  # fmt: skip


def test_ranks_ended_for_no_progress_blame_the_stopped_one_not_its_waiting_peers() -> None:
    """A stopped rank's peers wait for it in a collective: they stop beating too and their
    watchers end them as well, maybe first. The stopped process is the hang."""
    ranks = [stuck(0, 40.0, beats=31, last=9.0), stuck(1, 40.2, beats=31, last=9.0),
             stuck(2, 41.0, beats=31, last=9.1, stopped=True), stuck(3, 40.1, beats=31, last=9.0)]  # fmt: skip
    failure = classify(ranks, srun_status=137)
    assert (failure.kind, failure.culprit, failure.suspect_node) == ("hang", ranks[2], "n2")
    assert (failure.time, failure.detected) == (9.1, 41.0)  # its last progress; its end
    assert failure.culprit.describe() == (
        "rank 2 on n2 hung (no progress, ended by its watcher, the process was stopped)"
    )
    # none stopped (a deadlock in Python): the one that got least far, then the first stuck
    ranks = [stuck(0, 40.0, beats=31, last=9.0), stuck(1, 40.2, beats=30, last=9.3),
             stuck(2, 40.5, beats=31, last=8.0)]  # fmt: skip
    assert classify(ranks, srun_status=137).culprit == ranks[1]
    ranks = [stuck(0, 40.0, beats=31, last=9.0), stuck(1, 40.2, beats=31, last=8.5)]
    assert classify(ranks, srun_status=137).culprit == ranks[1]


def test_a_rank_seen_stopped_is_the_hang_even_after_srun_woke_it() -> None:
    """srun sends SIGCONT with its TERM as it ends the step: the stopped rank may then end
    by exit 7 like its peers. Its watcher saw it stopped before."""
    woken = RankEnd(3, "n2", started=0.0, ended=41.0, exit_code=7, stopped=True, beats=20,
                    last_progress=9.0)  # fmt: skip
    failure = classify([stuck(0, 40.0, beats=21, last=9.2), ended(1, 40.5, code=7),
                        ended(2, 40.6, code=7), woken], srun_status=137)  # fmt: skip
    assert (failure.kind, failure.culprit, failure.time) == ("hang", woken, 9.0)
    # with the heartbeat off: the peers' collectives timed out, srun woke it: still the hang
    failure = classify([ended(0, 610.0, code=7), woken], srun_status=7)
    assert (failure.kind, failure.culprit) == ("hang", woken)


def test_a_frozen_node_is_blamed_not_the_peers_its_watchers_ended() -> None:
    """A frozen node's watchers are frozen too: no end record. The other node's ranks
    stalled in a collective waiting for it and were ended by their own watchers."""
    frozen = [RankEnd(2, "n2", started=0.0), RankEnd(3, "n2", started=0.0)]
    failure = classify([stuck(0, 40.0, beats=31, last=9.0), stuck(1, 40.1, beats=31, last=9.2),
                        *frozen], srun_status=137)  # fmt: skip
    assert (failure.kind, failure.culprit, failure.suspect_node) == ("lost", frozen[0], "n2")
    assert failure.time == 9.0  # when the healthy ranks stopped hearing from it


def test_every_rank_started_and_none_ended_blames_the_node_slurm_says_went_away() -> None:
    """A node frozen for good (#47): SLURM marked it down after minutes, srun killed the
    healthy rank with its watcher, no rank had an end record; the lowest rank's node, the
    healthy one, was blamed and set aside."""
    none_ended = [RankEnd(r, f"n{r // 2 + 1}", started=0.0) for r in range(4)]
    failure = classify(none_ended, srun_status=1, gone=["n2"])  # sinfo: n2 down
    assert (failure.kind, failure.culprit, failure.suspect_node) == ("lost", none_ended[2], "n2")
    assert verdict(failure, healthy_spares=1).exclude == ("n2",)
    # without SLURM's word: n1's watchers saw srun's TERM (or srun reported n1's tasks
    # killed), n2 never answered
    alive = [RankEnd(r, "n1", started=0.0, alive_at_term=True) for r in (0, 1)]
    failure = classify([*alive, *none_ended[2:]], srun_status=1)
    assert (failure.kind, failure.suspect_node) == ("lost", "n2")


def test_first_failure_time_is_given_for_every_kind() -> None:
    """Goodput books the time from a failure to its detection (#47: it was null for `hang`
    and `lost`, so nothing said when the failure happened)."""
    kinds = {
        "signal": [ended(0, 10.2, code=7), ended(1, 10.0, sig=KILL)],
        "error": [ended(0, 5.0, code=1), ended(1, 5.5, code=7)],
        "distributed": [ended(0, 5.0, code=7), ended(1, 5.1, code=7)],
        "hang": [stuck(0, 40.0, beats=3, last=9.0), stuck(1, 40.0, beats=3, last=9.5)],
        "lost": [ended(0, 7.0, code=7), RankEnd(1, "n1", started=0.0)],
    }
    for kind, ranks in kinds.items():
        failure = classify(ranks, srun_status=1)
        summary = failure.summary()
        assert failure.kind == kind and summary is not None
        assert isinstance(summary["time"], float), (kind, summary)
    assert classify(kinds["lost"], srun_status=1).summary()["time"] == 7.0  # type: ignore[index]


def test_distributed_errors_alone_blame_no_node() -> None:
    failure = classify([ended(0, 1.0, code=7), ended(1, 1.1, code=7)], srun_status=7)
    assert failure.kind == "distributed" and failure.suspect_node == ""


def test_ranks_that_never_started_are_a_lost_node_unless_none_started() -> None:
    ranks = [ended(0, 1.0, code=7), ended(1, 1.0, code=7), RankEnd(2, "n2"), RankEnd(3, "n2")]
    failure = classify(ranks, srun_status=1)
    assert (failure.kind, failure.culprit, failure.suspect_node) == ("lost", ranks[2], "n2")
    assert classify([RankEnd(0, "n1"), RankEnd(1, "n1")], srun_status=1) == Failure("lost")


def test_the_trainers_requeue_code_and_slurms_own_signals_are_preemptions() -> None:
    saved = classify([ended(0, 1.0, code=REQUEUE_EXIT_CODE), ended(1, 1.0, code=REQUEUE_EXIT_CODE)],
                     srun_status=75)  # fmt: skip
    assert saved.kind == "preempted"
    stopped = classify([ended(0, 1.0, sig=TERM), ended(1, 1.0, sig=TERM)], srun_status=143)
    assert stopped.kind == "preempted"
    assert (
        classify([ended(0, 1.0, code=0), ended(1, 1.0, code=0)], srun_status=0).kind == "completed"
    )


# ------------------------------------------------------------------------------ decide
def test_a_killed_rank_restarts_in_place_without_a_spare_and_swaps_its_node_with_one() -> None:
    failure = classify([ended(0, 1.0, code=7), ended(1, 0.9, sig=KILL)], srun_status=143)
    here = verdict(failure, committed_end=12)
    assert here.action == "restart" and here.exclude == ()
    assert here.line == (
        "rank 1 on n1 killed by SIGKILL at step 12; restarting in this allocation "
        "(1/3, slurm.max_restarts)"
    )
    swapped = verdict(failure, committed_end=12, healthy_spares=1)
    assert swapped.action == "restart" and swapped.exclude == ("n1",)
    assert swapped.line.endswith("; n1 set aside")


def test_a_node_blamed_twice_running_is_set_aside_by_a_requeue_without_spares() -> None:
    failure = classify([ended(0, 1.0, sig=SEGV, node="n1")], srun_status=139)
    before = record("signal", node="n1", code=None, committed=12, resumed=10)
    again = verdict(failure, [before], committed_end=14, committed_start=12)
    assert (again.action, again.exclude) == ("requeue", ("n1",))
    assert again.line.endswith("; requeueing (n1 set aside)")


def test_a_lost_node_is_always_set_aside() -> None:
    failure = Failure("lost", RankEnd(2, "n2", started=0.0), "n2")
    assert verdict(failure, committed_end=11).action == "requeue"
    assert verdict(failure, committed_end=11, healthy_spares=1).exclude == ("n2",)


def test_the_users_error_is_never_retried_and_keeps_its_exit_code() -> None:
    failure = classify([ended(0, 1.0, code=2), ended(1, 1.0, code=2)], srun_status=2)
    stop = verdict(failure)
    assert (stop.action, stop.kind, stop.exit_code) == ("stop", "user", 2)
    assert "the user's error (exit 2-6: docs/errors.md), not retried" in stop.line


def test_the_same_exit_1_at_the_same_step_twice_is_a_bug() -> None:
    failure = classify([ended(0, 1.0, code=1)], srun_status=1)
    first = verdict(failure, committed_end=11)
    assert first.action == "restart"
    twice = verdict(failure, [record("error", step=12, committed=11)], committed_start=11,
                    committed_end=11)  # fmt: skip
    assert (twice.action, twice.kind, twice.exit_code) == ("stop", "bug", 1)
    assert (
        twice.line == "rank 0 on n1 exited 1 at step 12, as the attempt before: a bug, not retried"
    )
    elsewhere = verdict(failure, [record("error", step=9)], step_reached=12, committed_end=12)
    assert elsewhere.action == "restart"


def test_no_progress_stops_a_crash_loop_and_preemptions_do_not_count() -> None:
    failure = classify([ended(0, 1.0, sig=KILL)], srun_status=137)
    stuck = record("signal", committed=10, resumed=10, code=None, node="n2")
    stop = verdict(failure, [stuck])
    assert stop.action == "stop" and stop.exit_code == 128 + KILL
    assert stop.line.startswith(
        "stopped: no progress (2 attempts in a row committed no checkpoint, slurm.max_no_progress=2); "
        "last failure: rank 0 on n1 killed by SIGKILL at step 12"
    )
    preempted = record("preempted", committed=10, resumed=10)
    assert verdict(failure, [stuck, preempted]).action == "stop"  # skipped, not a reset
    assert verdict(failure, [stuck], committed_end=11).action == "restart"  # it progressed
    progressed = record("signal", committed=10, resumed=8, node="n3")
    assert verdict(failure, [stuck, progressed]).action == "restart"
    off = decide(failure, history=[stuck] * 5, policy=Policy(nodes=2, max_no_progress=0),
                 step_reached=1, committed_start=None, committed_end=None, restarts_here=0,
                 requeues=0, job_running=True)  # fmt: skip
    assert off.action == "restart"
    assert no_progress_run([stuck, preempted, stuck]) == 2


def test_restarts_run_out_into_a_requeue_then_a_stop() -> None:
    failure = classify([ended(0, 1.0, code=7), ended(1, 1.0, code=7)], srun_status=7)
    assert verdict(failure, committed_end=11, restarts_here=3).line.endswith(
        "; requeueing (3 restarts done here)"
    )
    done = verdict(failure, committed_end=11, restarts_here=3, requeues=3)
    assert done.action == "stop" and "slurm.max_restarts, slurm.max_requeues" in done.line


def test_restarts_go_on_while_attempts_progress_without_a_count() -> None:
    """slurm.max_restarts unset (0): a fourth, a tenth failure in one allocation restarts in
    it as long as each attempt committed a new checkpoint."""
    failure = classify([ended(0, 1.0, sig=KILL)], srun_status=137)
    progressing = [
        record("distributed", committed=10 * i, resumed=10 * (i - 1)) for i in range(1, 10)
    ]
    tenth = decide(failure, history=progressing, policy=Policy(nodes=2), step_reached=95,
                   committed_start=90, committed_end=93, restarts_here=9, requeues=0,
                   job_running=True)  # fmt: skip
    assert tenth.action == "restart" and tenth.line.endswith(
        "at step 95; restarting in this allocation (restart 10)"
    )
    counted = Policy(nodes=2, max_restarts=3)  # those who set it keep their bound
    assert decide(failure, history=progressing, policy=counted, step_reached=95,
                  committed_start=90, committed_end=93, restarts_here=3, requeues=0,
                  job_running=True).action == "requeue"  # fmt: skip


@pytest.mark.parametrize(
    ("kind", "resumed", "committed", "step", "lost"),
    [
        ("signal", 10, 10, 18, 100.0),  # committed nothing new: all of it
        ("signal", None, None, 5, 100.0),  # nothing committed at all
        ("signal", 10, 20, 30, 50.0),  # 20 steps trained, 10 past the commit: half
        ("hang", None, 10, 40, 75.0),  # from step 0: 30 of 40 past the commit
        ("transient", 10, 20, 20, 0.0),  # failed right at its commit
        ("user", 10, 10, 12, 0.0),  # not a failure the budget counts (never retried anyway)
        ("completed", 10, 20, 30, 0.0),
        ("preempted", 10, 10, 12, 0.0),  # announced: saved for
    ],
)
def test_the_seconds_a_failure_lost(kind: str, resumed: int | None, committed: int | None,
                                    step: int, lost: float) -> None:  # fmt: skip
    assert lost_seconds(0.0, 100.0, kind=kind, resumed_from=resumed, committed=committed,
                        step_reached=step) == pytest.approx(lost)  # fmt: skip


def test_failures_over_max_failure_share_of_the_allocation_stop_the_run() -> None:
    failure = classify([ended(0, 1.0, sig=KILL)], srun_status=137)
    bounded = Policy(nodes=2, max_failure_share=0.25)
    args = {"history": [], "step_reached": 12, "committed_start": 10, "committed_end": 11,
            "restarts_here": 0, "requeues": 0, "job_running": True}  # fmt: skip
    stop = decide(failure, policy=bounded, failure_share=0.3, **args)  # type: ignore[arg-type]
    assert (stop.action, stop.exit_code) == ("stop", 128 + KILL)
    assert stop.line == (
        "stopped: failures took 30 % of this allocation (slurm.max_failure_share=0.25); "
        "last failure: rank 0 on n1 killed by SIGKILL at step 12"
    )
    assert decide(failure, policy=bounded, failure_share=0.2, **args).action == "restart"  # type: ignore[arg-type]
    unbounded = decide(failure, policy=Policy(nodes=2), failure_share=0.9, **args)  # type: ignore[arg-type]
    assert unbounded.action == "restart"


def test_preemption_and_time_limit_requeue_within_max_requeues() -> None:
    saved = Failure("preempted", ended(0, 1.0, code=REQUEUE_EXIT_CODE))
    assert (verdict(saved).action, verdict(saved).kind) == ("requeue", "preempted")
    assert verdict(saved, near_time_limit=True).kind == "time_limit"
    spent = verdict(saved, requeues=3)
    assert (spent.action, spent.exit_code) == ("stop", REQUEUE_EXIT_CODE)
    assert "3 requeues done (slurm.max_requeues)" in spent.line


def test_a_job_no_longer_running_stops_whatever_happened() -> None:
    failure = classify([ended(0, 1.0, sig=KILL)], srun_status=137)
    stop = verdict(failure, job_running=False)
    assert (stop.action, stop.kind) == ("stop", "cancelled")


def test_a_failed_probe_requeues_without_the_bad_nodes() -> None:
    probe = verdict(Failure("probe"), set_aside=["n2"], committed_end=10)
    assert (probe.action, probe.exclude) == ("requeue", ("n2",))
    assert probe.line.startswith("too few nodes passed the health probe (n2 failed)")
    assert verdict(Failure("probe"), set_aside=["n2"], requeues=3).action == "stop"


# ------------------------------------------------------------------------------ place
def test_place_sets_aside_the_nodes_that_failed_and_keeps_allocation_order() -> None:
    probes = [ProbeResult("n1"), ProbeResult("n2", "local temp", "/tmp/x: Is a directory"),
              ProbeResult("n3")]  # fmt: skip
    placed = place(["n1", "n2", "n3"], [], probes, nodes=2)
    assert placed.nodes == ("n1", "n3")
    assert placed.set_aside == {"n2": "local temp: /tmp/x: Is a directory"}
    assert placed.line == "probe: n2 failed local temp: /tmp/x: Is a directory"
    assert place(["n1", "n2", "n3"], ["n1"], probes, nodes=2).nodes == ()  # n1 set aside before
    silent = place(["n1", "n2", "n3"], [], probes[:2], nodes=2)  # n3 never answered
    assert silent.nodes == () and "n3 failed answer" in silent.line


def test_place_trains_anyway_when_every_node_fails_the_same_shared_check() -> None:
    probes = [
        ProbeResult(n, "data", "data.train=/x: No such file", shared=True) for n in ("n1", "n2")
    ]
    placed = place(["n1", "n2"], [], probes, nodes=2)
    assert placed.nodes == ("n1", "n2") and placed.set_aside == {}
    assert "not a node's fault" in placed.line
    # one node alone failing a node-local check: the node, not the config
    lone = place(["n1"], [], [ProbeResult("n1", "local temp", "full")], nodes=1)
    assert lone.nodes == () and lone.set_aside == {"n1": "local temp: full"}
    assert place(["n1", "n2"], [], [], nodes=2).nodes == ("n1", "n2")  # no probe: all train
    gone = place(["n1"], ["n1"], [], nodes=1)  # SLURM drained it, or it failed before
    assert gone.nodes == () and gone.line == "0 node(s) left (n1 set aside), 1 needed"
    after = verdict(Failure("probe"), committed_end=10)
    assert (
        after.line
        == "too few nodes left in the allocation at step 12; requeueing (for other nodes)"
    )


# ------------------------------------------------------------------------------ the table
# One case per row of docs/clusters.md's "which failures are retried": how the ranks ended,
# the history before, the kind named and what follows.
STUCK = record("signal", committed=10, resumed=10, code=None, node="n2")  # committed nothing
ROWS = {
    "exit 2-6 on any rank: the user's, whatever else happened": (
        [ended(0, 2.0, sig=KILL), ended(1, 1.0, code=4), ended(2, 3.0, code=7)], [],
        "user", "stop",
    ),
    "exit 1 at a new step": ([ended(0, 1.0, code=1), ended(1, 1.2, code=7)], [], "error", "restart"),
    "exit 1 at the step of the attempt before": (
        [ended(0, 1.0, code=1)], [record("error", step=12)], "bug", "stop",
    ),
    "exit 8: a loader worker killed (OOM) or stuck, a shard read past its retries": (
        [ended(0, 1.0, code=7), ended(1, 0.9, code=8), ended(2, 1.1, sig=TERM)], [],
        "transient", "restart",
    ),
    "killed by a signal SLURM does not send": (
        [ended(0, 1.0, code=7), ended(1, 0.9, sig=KILL)], [], "signal", "restart",
    ),
    "exit 7 on every failed rank": ([ended(0, 1.0, code=7), ended(1, 1.1, code=7)], [],
                                    "distributed", "restart"),
    "its watcher ended it for making no progress (a stopped process)": (
        [ended(0, 40.0, code=7), dataclasses.replace(ended(1, 31.0, sig=KILL), hung=True,
                                                     stopped=True, last_progress=1.0)],
        [], "hang", "restart",
    ),
    "exit 7 on the others while one rank outlived srun's TERM": (
        [ended(0, 9.0, code=7), RankEnd(1, "n1", started=0.0, alive_at_term=True)], [],
        "hang", "restart",
    ),
    "exit 7 on the others while one rank's watcher went without a word": (
        [ended(0, 9.0, code=7), RankEnd(1, "n1", started=0.0)], [], "lost", "requeue",
    ),
    "ranks that never started, nothing else failed": (
        [ended(0, 1.0, code=7), ended(1, 1.0, code=7), RankEnd(2, "n2"), RankEnd(3, "n2")], [],
        "lost", "requeue",  # set aside: without a spare, through the queue
    ),
    "exit 75 (saved after USR2/TERM) or SLURM's own TERM": (
        [ended(0, 1.0, code=REQUEUE_EXIT_CODE), ended(1, 1.1, sig=TERM)], [],
        "preempted", "requeue",
    ),
    "a retried failure after attempts that committed nothing (slurm.max_no_progress)": (
        [ended(0, 1.0, code=8)], [STUCK], "transient", "stop",
    ),
}  # fmt: skip


@pytest.mark.parametrize("row", list(ROWS))
def test_each_row_of_the_retry_table(row: str) -> None:
    ranks, history, kind, action = ROWS[row]
    progress = {} if history == [STUCK] else {"committed_end": 12}
    result = verdict(classify(ranks, srun_status=1), history, **progress)
    assert (result.kind, result.action) == (kind, action), result.line
    if kind == "user":
        assert result.exit_code == 4 and result.culprit is not None and result.culprit.rank == 1
    if kind == "transient":
        assert result.exclude == () and "exited 8" in result.line  # no node blamed


def test_a_job_no_longer_running_and_a_failed_probe_are_the_tables_last_rows() -> None:
    gone = verdict(classify([ended(0, 1.0, code=8)], srun_status=8), job_running=False)
    assert (gone.kind, gone.action) == ("cancelled", "stop")
    probe = verdict(Failure("probe"), set_aside=["n2"], committed_end=10)
    assert (probe.kind, probe.action, probe.exclude) == ("probe", "requeue", ("n2",))


def test_a_user_error_before_sruns_sigkill_of_a_slow_peer_is_still_the_users() -> None:
    """srun ends a step whose task failed with TERM, then SIGKILL after KillWait: the rank
    that was slow to leave dies of a signal, and was not the failure."""
    ranks = [ended(0, 1.0, code=2), ended(1, 31.0, sig=KILL)]
    failure = classify(ranks, srun_status=2)
    assert (failure.kind, failure.culprit, failure.time) == ("user", ranks[0], 1.0)


def unreached(node: str, hub: str = "n1") -> ProbeResult:
    return ProbeResult(node, "collective", f"cannot reach {hub} (n1:4000): timed out", blames=hub)


def test_a_hub_nobody_reached_is_blamed_alone() -> None:
    """The collective is a star around the first node: its dead network fails every node."""
    hub = ProbeResult("n1", "collective", "no other node reached n1 within 60 s", peers_reached=0)
    probes = [hub, *(unreached(f"n{i}") for i in range(2, 6))]
    placed = place([f"n{i}" for i in range(1, 6)], [], probes, nodes=4)
    assert placed.nodes == ("n2", "n3", "n4", "n5") and list(placed.set_aside) == ["n1"]
    assert placed.set_aside["n1"].startswith(
        "collective: the hub, reached by 0 node(s); 4 could not reach it (n2, n3, n4, n5)"
    )
    # its probe never answered at all: the same
    silent = place([f"n{i}" for i in range(1, 6)], [], probes[1:], nodes=4)
    assert list(silent.set_aside) == ["n1"] and silent.nodes == ("n2", "n3", "n4", "n5")
    # a node that also failed a check of its own stays set aside for it
    own = place(["n1", "n2", "n3"], [], [hub, unreached("n2"), ProbeResult("n3", "gpus", "0")],
                nodes=1)  # fmt: skip
    assert list(own.set_aside) == ["n1", "n3"] and own.nodes == ("n2",)


def test_nodes_that_cannot_reach_a_hub_most_others_reached_are_at_fault() -> None:
    hub = ProbeResult("n1", peers_reached=3)
    probes = [hub, unreached("n2"), *(ProbeResult(f"n{i}") for i in range(3, 6))]
    placed = place([f"n{i}" for i in range(1, 6)], [], probes, nodes=4)
    assert list(placed.set_aside) == ["n2"] and placed.nodes == ("n1", "n3", "n4", "n5")


def test_one_probe_sets_aside_at_most_a_sixteenth_of_the_nodes_and_says_so() -> None:
    nodes = [f"n{i:03d}" for i in range(64)]
    probes = [ProbeResult(n, "gpus", "0 GPU(s) visible, 4 expected") if i % 4 == 0
              else ProbeResult(n) for i, n in enumerate(nodes)]  # fmt: skip
    placed = place(nodes, [], probes, nodes=40)
    assert len(placed.set_aside) == 4 == 64 // 16  # of 16 that failed
    assert list(placed.set_aside) == ["n000", "n004", "n008", "n012"]
    assert "; 12 more failed (n016, n020, n024, n028 and 8 more) but are not set aside: one " \
        "probe sets aside at most 4 of 64 nodes" in placed.line  # fmt: skip
    assert len(placed.nodes) == 40 and not set(placed.nodes) & {n for n in nodes[::4]}
    # too few left: the requeue excludes the four only
    short = place(nodes, [], probes, nodes=60)
    assert short.nodes == () and len(short.set_aside) == 4
    assert verdict(Failure("probe"), set_aside=sorted(short.set_aside)).exclude == tuple(
        sorted(short.set_aside)
    )
    # small jobs: two at least
    few = [ProbeResult("n1", "gpus", "0"), ProbeResult("n2", "gpus", "0"), ProbeResult("n3")]
    assert list(place(["n1", "n2", "n3"], [], few, nodes=1).set_aside) == ["n1", "n2"]


# ------------------------------------------------------------------------------ properties
EXITS = [0, 1, 2, 3, 4, 5, 6, 7, 8, 75, 137]
rank_end = st.builds(
    RankEnd,
    rank=st.integers(0, 7),
    node=st.sampled_from(["n1", "n2", "n3"]),
    started=st.one_of(st.none(), st.floats(0, 10)),
    ended=st.one_of(st.none(), st.floats(10, 20)),  # none: no end record
    exit_code=st.one_of(st.none(), st.sampled_from(EXITS)),
    signal=st.one_of(st.none(), st.sampled_from([KILL, TERM, SEGV, int(signal.SIGUSR2)])),
    hung=st.booleans(),
    stopped=st.booleans(),
    beats=st.one_of(st.none(), st.integers(0, 50)),
    last_progress=st.one_of(st.none(), st.floats(0, 20)),
    alive_at_term=st.booleans(),
)
steps = st.one_of(st.none(), st.integers(0, 30))
past = st.builds(
    record,
    st.sampled_from(["error", "bug", "transient", "signal", "distributed", "hang", "lost",
                     "probe", "preempted", "time_limit", "interrupted", "cancelled"]),
    committed=steps, resumed=steps, step=steps, code=st.sampled_from([None, 1, 7, 8]),
    node=st.sampled_from(["n1", "n2", "n3"]),
)  # fmt: skip
policies = st.builds(
    Policy,
    nodes=st.just(2),
    max_restarts=st.integers(0, 3),
    max_requeues=st.integers(0, 3),
    max_no_progress=st.integers(0, 3),
    max_failure_share=st.sampled_from([0.0, 0.1, 0.5]),
)


def users_exit(ranks: list[RankEnd]) -> int | None:
    """The first (by end) exit 2-6 of a rank that ended by itself (not ended by its watcher
    for making no progress), if any."""
    codes = sorted((r.ended, r.rank, r.exit_code) for r in ranks
                   if r.ended is not None and r.signal is None and not r.hung
                   and r.exit_code in range(2, 7))  # fmt: skip
    return codes[0][2] if codes else None


def stalled(history: list[AttemptRecord], progressed: bool) -> int:
    """Attempts in a row, this one included, that committed nothing (the table's rule)."""
    if progressed:
        return 0
    count = 1
    for r in reversed(history):
        if r.committed is not None and (r.resumed_from is None or r.committed > r.resumed_from):
            break
        count += r.kind not in ("preempted", "time_limit", "cancelled", "interrupted")
    return count


@settings(max_examples=200, deadline=None)
@given(ranks=st.lists(rank_end, min_size=1, max_size=8, unique_by=lambda r: r.rank),
       history=st.lists(past, max_size=4),
       policy=policies, restarts=st.integers(0, 5), requeues=st.integers(0, 4),
       spares=st.integers(0, 2), start=steps, end=steps, step=steps,
       share=st.floats(0, 1), running=st.booleans())  # fmt: skip
def test_no_user_error_is_retried_and_no_transient_failure_stops_but_by_the_rules(
    ranks: list[RankEnd], history: list[AttemptRecord], policy: Policy, restarts: int,
    requeues: int, spares: int, start: int | None, end: int | None, step: int | None,
    share: float, running: bool,
) -> None:  # fmt: skip
    """Any combination of rank ends (exit codes, signals, missing records, orders), history
    and budget. A user's exit 2-6 on any rank stops the job with that code; a failure that
    is not the user's is restarted or requeued, and stops only by one of the table's rules:
    the job is no longer running, the same exit 1 at the same step (a bug), no progress
    (`slurm.max_no_progress` attempts in a row without a new checkpoint), failures over
    `slurm.max_failure_share` of the allocation, or no requeue left when it had to requeue."""
    failure = classify(ranks, srun_status=1, gone=["n3"])
    if failure.culprit is not None:
        assert failure.culprit in ranks
    if failure.kind == "hang" and any(r.stopped and r.hung and r.failed for r in ranks):
        assert failure.culprit is not None and failure.culprit.stopped  # never its peers
    result = decide(
        failure, history=history, policy=policy, step_reached=step, committed_start=start,
        committed_end=end, restarts_here=restarts, requeues=requeues, job_running=running,
        healthy_spares=spares, failure_share=share,
    )  # fmt: skip
    assert result.action in ("done", "restart", "requeue", "stop") and "\n" not in result.line
    code = users_exit(ranks)
    if code is not None:
        assert failure.kind == "user" and result.action == "stop"
        assert result.exit_code == code or not running
        return
    assert failure.kind != "user"
    if failure.kind not in RETRYABLE or result.action != "stop":
        if result.action == "requeue":
            assert requeues < policy.max_requeues
        return
    progressed = end is not None and (start is None or end > start)
    may_stop = [
        not running and result.kind == "cancelled",
        result.kind == "bug" and failure.kind == "error",
        bool(policy.max_no_progress)
        and stalled(history, progressed) >= policy.max_no_progress
        and "no progress" in result.line,
        bool(policy.max_failure_share)
        and share > policy.max_failure_share
        and "slurm.max_failure_share" in result.line,
        requeues >= policy.max_requeues and "requeues done" in result.line,
    ]
    assert any(may_stop), (failure, result)


def test_the_requeue_code_is_the_trainers() -> None:
    from hpctrain.train.preemption import REQUEUE_EXIT_CODE as TRAINERS

    assert REQUEUE_EXIT_CODE == TRAINERS


@pytest.mark.parametrize("kind", ["completed", "preempted"])
def test_records_round_trip_through_json(kind: str) -> None:
    one = record(kind)
    assert AttemptRecord.from_json({**one.to_json(), "a_field_of_later": 1}) == one
