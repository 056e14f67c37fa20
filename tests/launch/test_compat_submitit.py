"""submitit's private API that hpctrain uses is still there (else: fail naming the version)."""

from __future__ import annotations

from pathlib import Path

import pytest
import submitit

from hpctrain import compat_submitit
from hpctrain.compat_submitit import SubmititChanged, check_compatible, render_submission


def test_the_installed_submitit_has_what_hpctrain_fences() -> None:
    """Fails on a submitit upgrade that moved `_make_sbatch_string` or its parameter names."""
    check_compatible()


def test_a_changed_submitit_is_named_in_the_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        compat_submitit,
        "SBATCH_STRING_PARAMETERS",
        compat_submitit.SBATCH_STRING_PARAMETERS | {"renamed_in_a_new_release"},
    )
    with pytest.raises(SubmititChanged) as info:
        check_compatible()
    assert f"submitit {submitit.__version__}" in str(info.value)
    assert "renamed_in_a_new_release" in str(info.value)


def test_render_submission_maps_generic_names(tmp_path: Path) -> None:
    script = render_submission(
        {"name": "j", "timeout_min": 30, "nodes": 2, "tasks_per_node": 4, "slurm_qos": "q"},
        command="python -u -m submitit.core._submit x",
        folder=tmp_path,
        map_count=3,
    )
    for line in ("#SBATCH --job-name=j", "#SBATCH --time=30", "#SBATCH --nodes=2",
                 "#SBATCH --ntasks-per-node=4", "#SBATCH --qos=q", "#SBATCH --array=0-2%3"):  # fmt: skip
        assert line in script, line
