"""How the ranks of an attempt ended, as its folder tells: the nodes' records (or, for
attempts begun before them, one record per rank; `resilience/node_records.py`) and srun's own
lines about the training step (`srun.log`, kept by the job script). `resilience/attempts.py
end` reads them; `restart_policy.classify` names the failure from them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hpctrain.distributed.env import expand_hostlist
from hpctrain.resilience.node_records import read_rank_records
from hpctrain.resilience.restart_policy import RankEnd

SRUN_LOG = "srun.log"  # srun's own lines about the training step (the job script keeps them)


def read_ranks(folder: Path, nodes: Sequence[str], tasks_per_node: int) -> list[RankEnd]:
    """Every rank of the attempt, from its node's record (or its own, in attempts begun
    before node records) or, without one, as never started (on the node srun's block
    distribution gave it)."""
    found = read_rank_records(folder, nodes, tasks_per_node)
    return [
        rank_end(rank, found.get(rank, {}), nodes[rank // tasks_per_node])
        for rank in range(len(nodes) * tasks_per_node)
    ]


def rank_end(rank: int, data: Mapping[str, Any], node: str) -> RankEnd:
    """One rank's end from its watcher's record (`resilience/watch.py`)."""
    hung = data.get("hung") if isinstance(data.get("hung"), dict) else None
    beat = data.get("progress")
    progress: Mapping[str, Any] = hung or (beat if isinstance(beat, dict) else {})
    return RankEnd(
        rank=rank,
        node=str(data.get("node") or node),
        started=data.get("started"),
        ended=data.get("ended"),
        exit_code=data.get("exit_code"),
        signal=data.get("signal"),
        received=tuple(data.get("received") or ()),
        hung=hung is not None,
        stopped=bool(data.get("stopped") or (hung or {}).get("stopped")),
        beats=progress.get("beats"),
        last_progress=progress.get("last_progress"),
        alive_at_term=data.get("term_alive") is not None,
    )


# srun's own lines (SLURM's src/srun): "srun: error: Node failure on n2", and how a task ended
# ("srun: error: n1: task 0: Killed", "...: tasks 0-3: Exited with exit code 7"): its node
# answered.
NODE_FAILURE = re.compile(r"Node failure on (\S+)")
TASK_ENDED = re.compile(r"srun: error: (\S+): tasks? [\d,\-\[\]]+: ")
# srun ending the step: --kill-on-bad-exit ("launch/slurm: _step_signal: Terminating
# StepId=7.1"), a node failure, a cancel. A task reported ended before it died on its own.
STEP_ENDING = re.compile(
    r"_step_signal: Terminating|Force Terminated|Node failure on|Job step aborted|CANCELLED"
)


def read_srun_log(folder: Path) -> tuple[set[str], set[str]]:
    """From the step's srun lines (`srun.log`): the nodes that failed, and those that
    reported a task's end once srun was ending the step (their node was there then).

    A task reported killed before srun began ending the step was not killed by srun: its
    watcher died with it (n2's watcher, rank and slurmd killed, its slurmstepd left to tell),
    which says nothing of the node being there at srun's TERM (#47: was `hang`, not `lost`).
    Without any such line from srun, every task's end counts."""
    try:
        text = (folder / SRUN_LOG).read_text(errors="replace")
    except OSError:
        return set(), set()
    failed: set[str] = set()
    for match in NODE_FAILURE.finditer(text):
        failed.update(expand_hostlist(match.group(1)))
    ending = STEP_ENDING.search(text)
    since = text[ending.start() :] if ending else text
    answered = {m.group(1) for m in TASK_ENDED.finditer(since)}
    return failed, answered - failed
