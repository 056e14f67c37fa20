"""The run configs shipped in configs/ load and pass the checks a job gets before it is queued.

A config the docs tell newcomers to copy must not go stale when a key is renamed or a rule
between keys is added: each one is loaded as `hpctrain config show` loads it, then given the
rules the trainer and `hpctrain preflight` run before any work (`check_rules`, `check_lora`,
the training plan on a cluster profile's GPUs). The fine-tuning configs leave
`model.init_from` to the command line, as their users do.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, load_config
from hpctrain.launch.preflight import check_lora_settings, check_plan
from hpctrain.launch.profiles import load_profile, resolve_job

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHIPPED = sorted(p.name for p in CONFIGS.glob("*.yaml"))
FINETUNE = ("finetune-lm.yaml", "finetune-lora.yaml")
BASE = "model.init_from=/models/llama-3.2-1b"  # a downloaded folder, named on the command line


def test_the_documented_configs_are_shipped() -> None:
    assert {"demo.yaml", "demo-lm.yaml", *FINETUNE} <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_each_shipped_config_shows(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    overrides = [BASE] if name in FINETUNE else []
    assert main(["config", "show", str(CONFIGS / name), *overrides]) == 0
    assert "run_dir: runs/" in capsys.readouterr().out


@pytest.mark.parametrize("name", FINETUNE)
@pytest.mark.parametrize("profile", ["jean-zay-h100", "jean-zay-a100"])
def test_the_finetune_configs_pass_preflights_plan_on_two_nodes(name: str, profile: str) -> None:
    """bf16 and FSDP2 on 2 nodes of A100s or H100s: the plan and LoRA rules accept them."""
    cfg = load_config(CONFIGS / name, [BASE, f"slurm.profile={profile}", "slurm.nodes=2"])
    job = resolve_job(cfg, load_profile(profile))
    plan_check, plan = check_plan(cfg, job)
    assert plan_check.ok and plan is not None, plan_check.message
    assert "bf16" in plan_check.message
    lora = check_lora_settings(cfg)
    assert lora is None or lora.ok, lora.message


def test_the_finetune_configs_hold_a_finetunes_values() -> None:
    """What #43 asks of them: not the demos' from-scratch values (lr 3e-3, 128 tokens)."""
    full, lora = (load_config(CONFIGS / name, [BASE]) for name in FINETUNE)
    for cfg in (full, lora):
        assert cfg.data.seq_len == 2048 and cfg.train.precision == "bf16"
        assert cfg.train.strategy == "fsdp" and cfg.train.schedule == "cosine"
        assert cfg.train.warmup_steps > 0 and cfg.checkpoint.every_minutes > 0
        assert cfg.checkpoint.every_steps == 0  # by time: a step's time depends on the model
        assert cfg.eval.generate and cfg.checkpoint.monitor == "val_loss"
        assert cfg.model.name == "" and cfg.data.val  # the shape comes from the folder
    assert full.train.lr == pytest.approx(2e-5) and full.model.lora.rank == 0
    assert lora.model.lora.rank > 0 and lora.model.lora.base_dtype == "bf16"
    assert full.train.lr < lora.train.lr <= 3e-4
    defaults = Config()
    assert full.train.lr < defaults.train.lr


def test_lora_without_a_base_is_refused_naming_the_key() -> None:
    cfg = load_config(CONFIGS / "finetune-lora.yaml")
    check = check_lora_settings(cfg)
    assert check is not None and not check.ok and "needs model.init_from" in check.message
