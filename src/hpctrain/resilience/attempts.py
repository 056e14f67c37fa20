"""The attempts of a job, step by step: `python -m hpctrain.resilience.attempts begin|place|end ...`.

Every job script (the sbatch templates of `launch/sbatch.py`, and the one the submitit job runs:
`launch/submit.py`) trains in a loop of attempts inside its allocation:

    begin   number the attempt, close one the job shell never finished, list the nodes to probe
    (srun)  the health probe, one task per node (resilience/probe.py)
    place   the nodes that passed: train on `slurm.nodes` of them, or requeue without the others
    (srun)  the training, every task under resilience/watch.py
    end     classify how the ranks ended, write the attempt's record, decide what comes next

Each step loads the run's config (the arguments `hpctrain train` gets), reads and writes the
run folder only (no SLURM command: they may be missing inside a container; the script runs
those), prints shell assignments on stdout for the script to `eval`, and one line for the job
log on stderr. The decisions themselves are the pure functions of `resilience/restart_policy.py`.

Files, all under RUN_DIR/slurm: `attempts.jsonl` (one `AttemptRecord` a line, the run's
history: docs/clusters.md) and `attempts/<N>/` (the attempt's own: `begin.json`,
`place.json`, `probe-<node>.json`, `node-<name>.json`: how the node's ranks started and
ended (`resilience/node_records.py`; `rank-<R>.json` in attempts begun before), and
`srun.log`: srun's own lines about the training step, which the job script keeps).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shlex
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hpctrain.config import Config, ConfigError, load_config
from hpctrain.distributed.env import expand_hostlist
from hpctrain.files import read_json_object, write_atomic
from hpctrain.observe.timeline import process_start_time, read_timeline
from hpctrain.resilience.placement import ProbeResult, place
from hpctrain.resilience.rank_ends import read_ranks, read_srun_log
from hpctrain.resilience.records import (
    FOLDERS,
    append_record,
    file_size,
    newest_committed,
    pointer_mark,
    read_records,
    slurm_folder,
    steps_logged_since,
)
from hpctrain.resilience.recovery import recovery, trainer_records
from hpctrain.resilience.restart_policy import (
    AttemptRecord,
    Failure,
    Policy,
    RankEnd,
    Verdict,
    classify,
    decide,
    failure_seconds,
    lost_seconds,
)

TIME_LIMIT_SLACK_S = 60.0  # SLURM checks limits every ~30 s: its warning may come that early


def policy_of(cfg: Config, job: JobFacts) -> Policy:
    s = cfg.slurm
    return Policy(
        nodes=nodes_to_train(cfg, job),
        max_restarts=s.max_restarts,
        max_requeues=s.max_requeues,
        max_no_progress=s.max_no_progress,
        max_failure_share=s.max_failure_share,
    )


def nodes_to_train(cfg: Config, job: JobFacts) -> int:
    """The allocation's nodes less `slurm.spare_nodes`: what `#SBATCH --nodes` asked for, so a
    script edited by hand (more nodes) trains on them all. `slurm.nodes` outside a job, and
    with `slurm.spare_nodes: auto` (the spares chosen when the job was rendered are the rest)."""
    spares = cfg.slurm.spare_nodes
    if not job.allocation or spares == "auto":
        return cfg.slurm.nodes
    return max(1, len(job.allocation) - spares)


@dataclass(frozen=True)
class JobFacts:
    """What the job's environment says (SLURM's variables in the batch shell)."""

    job_id: str
    restart: int
    allocation: tuple[str, ...]
    tasks_per_node: int
    end_time: float | None
    start_time: float | None = None  # SLURM_JOB_START_TIME (SLURM 23.02 on)

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> JobFacts:
        job = env.get("SLURM_JOB_ID", "")
        if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
            job = f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
        nodes = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST", "")
        tasks = env.get("SLURM_NTASKS_PER_NODE", "") or env.get("SLURM_TASKS_PER_NODE", "1")
        end = env.get("SLURM_JOB_END_TIME", "")
        start = env.get("SLURM_JOB_START_TIME", "")
        return cls(
            job_id=job,
            restart=int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            allocation=tuple(expand_hostlist(nodes)) if nodes else (),
            tasks_per_node=int(tasks.split("(")[0].split(",")[0] or 1),
            end_time=float(end) if end.isdigit() else None,
            start_time=float(start) if start.isdigit() else None,
        )


def same_allocation(record: AttemptRecord, job: JobFacts) -> bool:
    return record.job_id == job.job_id and record.restart == job.restart


# Read by the tasks (the run lock takes over an earlier attempt's: checkpoint/lock.py), the
# rendezvous (distributed/env.py: the first node's fabric address, from its probe) and the
# watchers (the job script started a fork server per node: resilience/forkserver.py)
EXPORTED = frozenset({"HPCTRAIN_ATTEMPT", "HPCTRAIN_FABRIC_MASTER", "HPCTRAIN_FORKSERVER"})


def _shell(**values: object) -> str:
    """`KEY=value` lines for the script's eval (lists become bash arrays)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, (list, tuple)):
            lines.append(f"{key}=({' '.join(shlex.quote(str(v)) for v in value)})")
        else:
            export = "export " if key in EXPORTED else ""
            lines.append(f"{export}{key}={shlex.quote(str(value))}")
    return "\n".join(lines)


def _say(line: str) -> None:
    sys.stderr.write(f"hpctrain: {line}\n")  # one write: the job log's line stays whole
    sys.stderr.flush()


def _write_json(path: Path, data: Mapping[str, Any]) -> None:
    write_atomic(path, (json.dumps(data) + "\n").encode())


# ------------------------------------------------------------------------------ begin
def close_unfinished(run_dir: Path, records: list[AttemptRecord], root: str) -> list[AttemptRecord]:
    """Records for attempts whose job shell was killed before their `end` (a hard time limit,
    a node failure, SLURM's own requeue): kind "interrupted", ended when their files last
    changed. The run's history stays whole for `hpctrain status` and the goodput."""
    done = {r.attempt for r in records}
    folders = slurm_folder(run_dir) / FOLDERS
    numbers = (
        sorted(int(p.name) for p in folders.iterdir() if p.name.isdigit())
        if folders.is_dir()
        else []
    )
    for number in numbers:
        folder = folders / str(number)
        begun = read_json_object(folder / "begin.json")
        if number in done or not begun:
            continue
        placed = read_json_object(folder / "place.json")
        last = max((p.stat().st_mtime for p in folder.iterdir()), default=begun["start"])
        record = AttemptRecord(
            attempt=number, job_id=begun["job_id"], restart=begun["restart"],
            start=begun["start"], end=last, nodes=placed.get("nodes", []),
            excluded=begun.get("excluded", []), num_tasks=placed.get("num_tasks", 0),
            kind="interrupted", decision="requeue",
            reason="the job ended under this attempt (time limit, node failure or SLURM's requeue)",
            step_reached=steps_logged_since(run_dir, begun.get("metrics_offset", 0)),
            resumed_from=begun.get("committed"), committed=newest_committed(root),
        )  # fmt: skip
        append_record(run_dir, record)
        records.append(record)
    return records


def submission_start(
    folders: Path, number: int, job: JobFacts, records: Sequence[AttemptRecord]
) -> dict[str, Any] | None:
    """Where the submission (the job id, its requeues included) attempt `number` belongs to
    started: what the previous attempt's `begin.json` says, when it was of this job and did
    not end it (done, stop). None: this attempt starts the submission."""
    ended = {r.attempt for r in records if r.decision in ("done", "stop")}
    start: dict[str, Any] | None = None
    for earlier in range(number - 1, 0, -1):
        begun = read_json_object(folders / str(earlier) / "begin.json")
        if not begun:
            continue  # a folder its job shell was killed in before it wrote begin.json
        if begun.get("job_id") != job.job_id or earlier in ended:
            break
        if isinstance(begun.get("submission"), dict):
            return dict(begun["submission"])
        # an older job script's record, without the submission: its first attempt's step
        start = {k: begun.get(k) for k in ("job_id", "restart", "attempt", "committed")}
    return start


def committed_here(submission: Mapping[str, Any], committed: int | None, mark: str | None) -> bool:
    """The newest checkpoint was committed by this submission: the `latest` pointer was
    written since it started (its step alone, for records without the pointer's mark)."""
    if committed is None:
        return False
    if "pointer" in submission:
        return mark != submission["pointer"]
    return committed != submission.get("committed")


def killed_before(records: Sequence[AttemptRecord], job: JobFacts) -> bool:
    """Whether the attempt before, in this allocation, was restarted after its first rank was
    killed by SIGKILL (the OOM killer, `kill -9`): what the health probe checks (folders,
    disks, /dev/shm, GPUs, the network) cannot explain it, so the restart goes without it."""
    if not records or not same_allocation(records[-1], job):
        return False
    last = records[-1]
    failure = last.first_failure or {}
    return (last.kind, last.decision, failure.get("signal")) == ("signal", "restart", "SIGKILL")


def begin(cfg: Config, job: JobFacts, *, down: Sequence[str] = ()) -> str:
    """Start an attempt: its number and folder, the nodes to probe, the resume to ask for."""
    run_dir = Path(cfg.run_dir)
    root = cfg.checkpoint_root()
    records = close_unfinished(run_dir, read_records(run_dir), root)
    folders = slurm_folder(run_dir) / FOLDERS
    folders.mkdir(parents=True, exist_ok=True)
    taken = [int(p.name) for p in folders.iterdir() if p.name.isdigit()]
    number = max([0, *taken, *(r.attempt for r in records)]) + 1
    folder = folders / str(number)
    folder.mkdir()
    excluded = sorted(
        {n for r in records if same_allocation(r, job) for n in r.set_aside}
        | (set(down) & set(job.allocation))
    )
    committed, mark = newest_committed(root), pointer_mark(root)
    submission = submission_start(folders, number, job, records) or {
        "job_id": job.job_id, "restart": job.restart, "attempt": number,
        "committed": committed, "pointer": mark,
    }  # fmt: skip
    probe = [n for n in job.allocation if n not in excluded]
    unexplained = killed_before(records, job) and not cfg.slurm.probe_after_kill
    probe = [] if unexplained else probe
    _write_json(
        folder / "begin.json",
        {
            "attempt": number, "job_id": job.job_id, "restart": job.restart,
            "start": time.time(), "excluded": excluded, "committed": committed,
            "metrics_offset": file_size(run_dir / "metrics.jsonl"), "submission": submission,
            "probe": probe if cfg.slurm.probe else [],  # the nodes the probe checks
        },
    )  # fmt: skip
    # A later attempt of the same submission (a restart, a requeue) continues from the
    # checkpoint that submission committed, whatever its checkpoint.resume says (none, or a
    # path: where the submission started). Until it has committed one, the user's choice
    # stands: a new job that rolls back to a path after an interrupted one, a `--resume none`
    # job whose first attempt failed its probe.
    own = committed_here(submission, committed, mark)
    resume = ["checkpoint.resume=latest"] if own else []
    aside = f", {','.join(excluded)} set aside" if excluded else ""
    probes = (
        "skips the probe (a rank killed by SIGKILL: no check of it explains that; "
        "slurm.probe_after_kill)"
        if unexplained
        else f"probes {','.join(probe)}"
    )
    _say(f"attempt {number} (job {job.job_id}, restart {job.restart}) {probes}{aside}")
    return _shell(
        ATTEMPT=number,
        ATTEMPT_DIR=str(folder),
        PROBE_NODES=",".join(probe),
        NUM_PROBE_NODES=len(probe),
        HPCTRAIN_ATTEMPT=number,
        HPCTRAIN_FORKSERVER=int(cfg.slurm.forkserver),
        RESUME=resume,
    )


def begin_and_place(cfg: Config, job: JobFacts, *, down: Sequence[str] = ()) -> str:
    """`begin`, and when the attempt runs no probe, its placement too (`PLACED=1` and the
    nodes: one process less before the training's srun). A placement that finds too few
    nodes is left to `attempts place`, which decides what follows."""
    text = begin(cfg, job, down=down)
    folder = current_folder(Path(cfg.run_dir))
    begun = read_json_object(folder / "begin.json")
    if begun.get("probe"):
        return text
    placement = place(job.allocation, begun.get("excluded", []), [], nodes=nodes_to_train(cfg, job))
    if not placement.nodes:
        return text
    num_tasks = len(placement.nodes) * job.tasks_per_node
    _write_json(
        folder / "place.json",
        {"nodes": list(placement.nodes), "num_tasks": num_tasks, "set_aside": {}, "time": time.time()},
    )  # fmt: skip
    placed = _shell(
        PLACED=1,
        TRAIN_NODES=",".join(placement.nodes),
        NUM_NODES=len(placement.nodes),
        NUM_TASKS=num_tasks,
    )
    return f"{text}\n{placed}"


def current_folder(run_dir: Path) -> Path:
    folders = slurm_folder(run_dir) / FOLDERS
    numbers = (
        [int(p.name) for p in folders.iterdir() if p.name.isdigit()] if folders.is_dir() else []
    )
    if not numbers:
        raise ConfigError(f"{folders}: no attempt begun (run `attempts begin` first)")
    return folders / str(max(numbers))


# ------------------------------------------------------------------------------ place
def read_probes(folder: Path) -> list[ProbeResult]:
    results = []
    for path in sorted(folder.glob("probe-*.json")):
        data = read_json_object(path)
        reached = data.get("peers_reached")  # the collective's hub only
        if data.get("node"):
            results.append(
                ProbeResult(
                    node=str(data["node"]),
                    failed_check=str(data.get("failed_check", "")),
                    message=str(data.get("message", "")),
                    shared=bool(data.get("shared", False)),
                    blames=str(data.get("blames", "")),
                    peers_reached=reached if isinstance(reached, int) else None,
                )
            )
    return results


def place_attempt(cfg: Config, job: JobFacts) -> str:
    """After the probe: the nodes this attempt trains on, or the requeue/stop without them."""
    run_dir = Path(cfg.run_dir)
    folder = current_folder(run_dir)
    begun = read_json_object(folder / "begin.json")
    placement = place(
        job.allocation,
        begun.get("excluded", []),
        read_probes(folder),
        nodes=nodes_to_train(cfg, job),
    )
    if placement.line:
        _say(placement.line)
    num_tasks = len(placement.nodes) * job.tasks_per_node
    _write_json(
        folder / "place.json",
        {
            "nodes": list(placement.nodes), "num_tasks": num_tasks,
            "set_aside": placement.set_aside, "time": time.time(),
        },
    )  # fmt: skip
    if placement.nodes:
        first = placement.nodes[0]  # rank 0's node: the store's address on the fabric, if any
        address = str(read_json_object(folder / f"probe-{first}.json").get("fabric_address") or "")
        return _shell(
            NEXT="train",
            TRAIN_NODES=",".join(placement.nodes),
            NUM_NODES=len(placement.nodes),
            NUM_TASKS=num_tasks,
            HPCTRAIN_FABRIC_MASTER=f"{first}={address}" if address else "",
        )
    records = read_records(run_dir)
    verdict = decide(
        Failure("probe"),
        history=records,
        policy=policy_of(cfg, job),
        step_reached=None,
        committed_start=begun.get("committed"),
        committed_end=begun.get("committed"),
        restarts_here=sum(same_allocation(r, job) for r in records),
        requeues=job.restart,
        job_running=True,
        set_aside=sorted(placement.set_aside),
    )
    return _finish(cfg, job, folder, begun, verdict, ranks=(), srun_status=None)


# ------------------------------------------------------------------------------ end
def allocation_share(
    job: JobFacts, here: Sequence[AttemptRecord], started: float, seconds: float
) -> float:
    """`seconds` as a share of this allocation's length, from its start (SLURM's, else its
    first attempt's) to its end time; 0 when the end time is unknown (the job scripts ask
    squeue for it where SLURM does not export it)."""
    if job.end_time is None:
        return 0.0
    start = job.start_time or min([started, *(r.start for r in here)])
    length = job.end_time - start
    return seconds / length if length > 0 else 0.0


def end_attempt(
    cfg: Config,
    job: JobFacts,
    *,
    srun_status: int,
    state: str,
    down: Sequence[str] = (),
    step_end: float | None = None,
) -> str:
    """After the training step: the attempt's record, and what the job does next.

    `down`: the nodes SLURM lists as down, drained or failing once the step ended.
    `step_end`: when the training step had ended (default: when this process started, as
    srun returned and squeue answered)."""
    step_end = process_start_time() if step_end is None else step_end
    run_dir = Path(cfg.run_dir)
    folder = current_folder(run_dir)
    begun = read_json_object(folder / "begin.json")
    placed = read_json_object(folder / "place.json")
    nodes = placed.get("nodes", [])
    ranks = read_ranks(folder, nodes, job.tasks_per_node)
    failed_nodes, answered = read_srun_log(folder)
    # a rank whose node told srun how its task ended was there when the step was ended
    ranks = [
        dataclasses.replace(r, alive_at_term=True)
        if r.ended is None and r.node in answered and r.node not in down
        else r
        for r in ranks
    ]
    failure = classify(
        ranks, srun_status=srun_status, gone=sorted((set(down) | failed_nodes) & set(nodes))
    )
    records = read_records(run_dir)
    excluded = {*begun.get("excluded", []), *placed.get("set_aside", {})}
    available = [n for n in job.allocation if n not in excluded]
    margin = max(cfg.slurm.signal_margin_s, cfg.checkpoint.deadline_margin_s) + TIME_LIMIT_SLACK_S
    now = time.time()
    committed_end = newest_committed(cfg.checkpoint_root())
    step_reached = steps_logged_since(run_dir, begun.get("metrics_offset", 0))
    here = [r for r in records if same_allocation(r, job)]
    lost = failure_seconds(here) + lost_seconds(
        float(begun["start"]), now, kind=failure.kind, resumed_from=begun.get("committed"),
        committed=committed_end, step_reached=step_reached,
    )  # fmt: skip
    verdict = decide(
        failure,
        history=records,
        policy=policy_of(cfg, job),
        step_reached=step_reached,
        committed_start=begun.get("committed"),
        committed_end=committed_end,
        restarts_here=len(here),
        requeues=job.restart,
        job_running=state in ("RUNNING", ""),
        near_time_limit=job.end_time is not None and job.end_time - now <= margin,
        healthy_spares=len(available) - nodes_to_train(cfg, job),
        failure_share=allocation_share(job, here, float(begun["start"]), lost),
    )
    return _finish(
        cfg, job, folder, begun, verdict, ranks=ranks, srun_status=srun_status,
        failure=failure, step_end=step_end,
        recovered=restart_phases(run_dir, records, job, begun, placed),
    )  # fmt: skip


def restart_phases(
    run_dir: Path,
    records: Sequence[AttemptRecord],
    job: JobFacts,
    begun: Mapping[str, Any],
    placed: Mapping[str, Any],
) -> dict[str, Any] | None:
    """The restart that led to this attempt, phase by phase (`resilience/recovery.py`): when
    the attempt before it, in the same allocation, failed and was restarted; else None."""
    if not records or records[-1].decision != "restart" or not same_allocation(records[-1], job):
        return None
    startup, first = trainer_records(read_timeline(run_dir), int(begun["attempt"]))
    return recovery(records[-1], begun, placed, startup, first)


def _finish(
    cfg: Config,
    job: JobFacts,
    folder: Path,
    begun: Mapping[str, Any],
    verdict: Verdict,
    *,
    ranks: Sequence[RankEnd],
    srun_status: int | None,
    failure: Failure | None = None,
    step_end: float | None = None,
    recovered: dict[str, Any] | None = None,
) -> str:
    run_dir = Path(cfg.run_dir)
    placed = read_json_object(folder / "place.json")
    set_aside = dict(placed.get("set_aside", {}))
    for node in verdict.exclude:
        set_aside.setdefault(
            node, f"{verdict.kind}: {verdict.culprit.describe() if verdict.culprit else 'suspect'}"
        )
    record = AttemptRecord(
        attempt=int(begun["attempt"]), job_id=job.job_id, restart=job.restart,
        start=float(begun["start"]), end=time.time(), nodes=list(placed.get("nodes", [])),
        excluded=list(begun.get("excluded", [])), num_tasks=len(ranks),
        kind=verdict.kind, decision=verdict.action, reason=verdict.line,
        first_failure=_first_failure(verdict, failure),
        step_reached=steps_logged_since(run_dir, begun.get("metrics_offset", 0)),
        resumed_from=begun.get("committed"), committed=newest_committed(cfg.checkpoint_root()),
        set_aside=set_aside, srun_status=srun_status, exit_code=verdict.exit_code,
        step_end=step_end, recovery=recovered,
    )  # fmt: skip
    # A requeue excludes every node set aside in this allocation, not this attempt's only:
    # an earlier attempt's blamed node would come back in the next allocation otherwise.
    earlier = [r for r in read_records(run_dir) if same_allocation(r, job)]
    append_record(run_dir, record)
    _say(f"attempt {record.attempt}: {verdict.line}")
    exclude = sorted({n for r in [*earlier, record] for n in r.set_aside})
    return _shell(NEXT=verdict.action, EXCLUDE=",".join(exclude), EXIT=verdict.exit_code)


def _first_failure(verdict: Verdict, failure: Failure | None) -> dict[str, Any] | None:
    if verdict.culprit is None:
        return None
    if failure is not None and failure.culprit == verdict.culprit:
        return failure.summary()
    return verdict.culprit.summary()


# ------------------------------------------------------------------------------ main
def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpctrain.resilience.attempts")
    parser.add_argument("step", choices=("begin", "place", "end"))
    parser.add_argument(
        "--down", default="", help="begin, end: nodes SLURM lists as down, drained or failing"
    )
    parser.add_argument("--status", type=int, default=0, help="end: srun's exit status")
    parser.add_argument("--state", default="", help="end: the job's state (squeue %%T)")
    parser.add_argument("config")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)
    env = os.environ if environ is None else environ
    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as exc:
        _say(f"attempts {args.step}: config error: {exc}")
        return exc.exit_code
    job = JobFacts.from_environ(env)
    down = expand_hostlist(args.down.replace(" ", ",")) if args.down.strip() else []
    if args.step == "begin":
        print(begin_and_place(cfg, job, down=down))
    elif args.step == "place":
        print(place_attempt(cfg, job))
    else:
        print(end_attempt(cfg, job, srun_status=args.status, state=args.state.strip(), down=down))
        if read_records(Path(cfg.run_dir))[-1].decision == "restart":
            # the next attempt begins here: one process less between the two trainings
            print(begin_and_place(cfg, job, down=down))
            print("BEGUN=1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
