"""The house rules (`tools/house.py`): no import cycle, imports inside functions counted; no
module over 600 lines; private torch/submitit names only in the compat modules."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))

import house  # noqa: E402


def test_no_import_cycle() -> None:
    assert house.cycles(house.import_graph()) == []


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
