"""Install hints: the clone's own command when hpctrain runs from a clone, the index's otherwise."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from hpctrain.errors import install_hint, source_clone

CLONE = Path(__file__).resolve().parents[1]


def test_from_a_clone_the_hint_installs_the_clone_s_extras(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert source_clone() == CLONE  # this suite runs hpctrain from the clone's src/
    monkeypatch.chdir(CLONE)
    assert install_hint("text", "hf") == "pip install -e '.[text,hf]'"
    monkeypatch.chdir(tmp_path)  # elsewhere: the clone's path, not '.'
    assert install_hint("arrow") == f"pip install -e '{CLONE}[arrow]'"


def test_an_installed_package_s_hint_names_the_package_index(tmp_path: Path) -> None:
    site = tmp_path / "site-packages" / "hpctrain"
    site.mkdir(parents=True)
    shutil.copy(CLONE / "src" / "hpctrain" / "errors.py", site / "errors.py")
    spec = importlib.util.spec_from_file_location("installed_errors", site / "errors.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["installed_errors"] = module
    try:
        spec.loader.exec_module(module)
        assert module.source_clone() is None
        assert module.install_hint("text") == "pip install 'hpctrain[text]'"
    finally:
        del sys.modules["installed_errors"]
