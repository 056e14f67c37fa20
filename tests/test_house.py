"""The house rules (`tools/house.py`): no import cycle, imports inside functions counted; imports
run one way between packages (floors); no module over 600 lines; private torch/submitit names
only in the compat modules."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import house  # noqa: E402


def test_no_import_cycle() -> None:
    assert house.cycles(house.import_graph()) == []


def test_imports_run_one_way_between_the_packages() -> None:
    assert house.upward_imports(house.import_graph()) == []


def test_every_package_has_a_floor_and_the_loop_is_above_its_parts() -> None:
    packages = {house.package_of(m) for m in house.import_graph()}
    assert packages <= set(house.FLOORS), packages - set(house.FLOORS)
    floors = house.FLOORS
    for lower in ("tasks", "models", "observe", "parallel", "data", "checkpoint"):
        assert floors[lower] < floors["train"] < floors["launch"], lower
    assert floors["parallel"] <= floors["tasks"]  # parallel never imports tasks


def test_an_import_up_a_floor_or_from_an_unplaced_package_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "hpctrain"
    for sub in ("tasks", "train", "parallel", "extra"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "tasks" / "t.py").write_text("def f():\n    from hpctrain.train import loop\n")
    (pkg / "train" / "loop.py").write_text("from hpctrain.tasks import t\n")
    (pkg / "parallel" / "p.py").write_text("import hpctrain.tasks.t\n")
    (pkg / "extra" / "e.py").write_text("")
    found = house.upward_imports(house.import_graph(pkg))
    assert found == [
        "hpctrain.parallel.p -> hpctrain.tasks.t (floor 5 -> 6)",
        "hpctrain.tasks.t -> hpctrain.train (floor 6 -> 7)",
        "hpctrain.tasks.t -> hpctrain.train.loop (floor 6 -> 7)",
        "unplaced: extra",
    ]


def test_no_module_over_600_lines() -> None:
    assert house.long_modules() == []


def test_private_torch_names_only_in_the_compat_modules() -> None:
    assert house.private_uses() == []


def test_function_local_imports_and_private_names_are_found(tmp_path: Path) -> None:
    pkg = tmp_path / "hpctrain"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f():\n    from hpctrain import b\n")
    (pkg / "b.py").write_text(
        "import torch\n\ndef g():\n    from hpctrain.a import f\n    torch._dynamo.reset()\n"
    )
    assert house.cycles(house.import_graph(pkg)) == [["hpctrain.a", "hpctrain.b"]]
    assert house.private_uses(pkg) == ["hpctrain.b:5 _dynamo"]
