"""The parts of submitit hpctrain uses that are not its public API, fenced in one place.

`hpctrain submit --dry-run` prints the script submitit would submit, which only submitit's
private `_make_sbatch_string` can render, with the executor's parameters under
`SlurmExecutor`'s names (the table below mirrors `SlurmExecutor._equivalence_dict`). A submitit
release that renames either breaks `--dry-run` silently unless checked: `check_compatible`
raises naming the installed submitit version and what changed, and
tests/test_compat_submitit.py calls it, so an upgrade fails the test suite loudly instead.

A training job (`launch/submit.py` `training_parameters`) also relies on two behaviours of
the public parameters: `use_srun=False` runs the job's one process in the batch step, and a
key of `additional_parameters` replaces the #SBATCH line of the same regular parameter (the
allocation's real nodes and tasks per node, while submitit counts one task). Both are
checked here too.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import submitit

# AutoExecutor's generic parameter names → SlurmExecutor's, for the ones hpctrain sets.
GENERIC_TO_SLURM = {
    "name": "job_name",
    "timeout_min": "time",
    "nodes": "nodes",
    "cpus_per_task": "cpus_per_task",
    "tasks_per_node": "ntasks_per_node",
}

# Keyword arguments of `_make_sbatch_string` hpctrain passes (through executor parameters).
SBATCH_STRING_PARAMETERS = frozenset(
    {"command", "folder", "job_name", "partition", "time", "nodes", "ntasks_per_node",
     "cpus_per_task", "qos", "setup", "signal_delay_s", "constraint", "account", "gres",
     "additional_parameters", "srun_args", "array_parallelism", "map_count", "use_srun"}
)  # fmt: skip


class SubmititChanged(RuntimeError):
    """The installed submitit no longer has the private API hpctrain relies on."""


def _private_sbatch_renderer() -> Any:
    from submitit.slurm import slurm

    renderer = getattr(slurm, "_make_sbatch_string", None)
    if renderer is None:
        raise SubmititChanged(
            f"submitit {submitit.__version__}: submitit.slurm.slurm._make_sbatch_string is gone; "
            "update hpctrain/compat_submitit.py"
        )
    return renderer


def check_compatible() -> None:
    """Raise `SubmititChanged` naming the submitit version if the fenced private API moved."""
    renderer = _private_sbatch_renderer()
    accepted = set(inspect.signature(renderer).parameters)
    missing = sorted(SBATCH_STRING_PARAMETERS - accepted)
    if missing:
        raise SubmititChanged(
            f"submitit {submitit.__version__}: _make_sbatch_string no longer takes {', '.join(missing)}; "
            "update hpctrain/compat_submitit.py"
        )
    from submitit.slurm.slurm import SlurmExecutor

    table = SlurmExecutor._equivalence_dict()
    changed = {k: v for k, v in GENERIC_TO_SLURM.items() if k != v and table.get(k) != v}
    if changed:
        raise SubmititChanged(
            f"submitit {submitit.__version__}: SlurmExecutor maps generic parameters differently "
            f"({', '.join(f'{k}->{table.get(k)!r}, expected {v!r}' for k, v in changed.items())}); "
            "update hpctrain/compat_submitit.py"
        )
    shaped = renderer(
        command="python -m x", folder="/tmp/x", nodes=1, ntasks_per_node=1, use_srun=False,
        additional_parameters={"nodes": 3, "ntasks_per_node": 4},
    )  # fmt: skip
    if "--nodes=3" not in shaped or "--nodes=1" in shaped or "\nsrun " in shaped:
        raise SubmititChanged(
            f"submitit {submitit.__version__}: additional_parameters no longer replace nodes/ntasks_per_node, "
            "or use_srun=False still runs srun; update hpctrain/compat_submitit.py and launch/submit.py"
        )
    python_parameter = inspect.signature(SlurmExecutor.__init__).parameters.get("python")
    if python_parameter is None:
        raise SubmititChanged(
            f"submitit {submitit.__version__}: SlurmExecutor no longer takes python= (containers need it); "
            "update hpctrain/compat_submitit.py"
        )


def slurm_parameters(executor_parameters: dict[str, Any]) -> dict[str, Any]:
    """AutoExecutor parameters (`slurm_*` and generic names) → `_make_sbatch_string` keywords."""
    params = {}
    for key, value in executor_parameters.items():
        name = key[len("slurm_") :] if key.startswith("slurm_") else GENERIC_TO_SLURM[key]
        params[name] = value
    return params


def render_submission(
    executor_parameters: dict[str, Any], *, command: str, folder: Path, map_count: int | None = None
) -> str:
    """The sbatch script submitit writes for these AutoExecutor parameters.

    Args:
        executor_parameters: as given to `AutoExecutor.update_parameters`.
        command: the job's command (`PYTHON -u -m submitit.core._submit FOLDER`).
        folder: submitit's job folder.
        map_count: the number of array tasks for a job array (`executor.batch()`), else None.
    """
    params = slurm_parameters(executor_parameters)
    if map_count is not None:
        params["map_count"] = map_count
    return str(_private_sbatch_renderer()(command=command, folder=folder, **params))
