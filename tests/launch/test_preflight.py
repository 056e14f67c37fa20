"""Preflight: every problem found in one pass, one line each, nothing queued."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from hpctrain.cli.main import main
from hpctrain.config import Config, with_overrides
from hpctrain.launch.checks import Check
from hpctrain.launch.preflight import (
    LOGIN_NODE,
    check_login_node,
    failed,
    format_checks,
    has_module_command,
    preflight,
    raise_if_failed,
)
from hpctrain.launch.profiles import LaunchError, load_profile, resolve_job

REPO = Path(__file__).resolve().parents[2]


def checks_for(*overrides: str, profile: str = "local-dev"):  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), [f"slurm.profile={profile}", *overrides])
    return preflight(cfg, load_profile(profile))


def by_name(checks):  # type: ignore[no-untyped-def]
    return {c.name: c for c in checks}


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_good_config_passes(tiny_shards: Path, tmp_path: Path) -> None:
    checks = checks_for(
        f"run_dir={tmp_path / 'run'}",
        f"data.train={tiny_shards / 'train' / 'index.json'}",
        f"data.val={tiny_shards / 'val'}",
    )
    assert failed(checks) == [], format_checks(checks)
    assert "sample shards open" in by_name(checks)["data.train"].message


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    checks = by_name(
        checks_for(
            f"run_dir={blocker / 'run'}",
            f"data.train={tmp_path / 'missing' / 'index.json'}",
            "task=no_such_module:Task",
            "slurm.time=500",
            "slurm.qos=qos_gpu-dev",
            profile="jean-zay-v100",
        )
    )
    assert not checks["profile"].ok and "slurm.time" in checks["profile"].message
    assert not checks["run_dir"].ok and "not writable" in checks["run_dir"].message
    assert not checks["data.train"].ok
    assert not checks["task"].ok and "no_such_module" in checks["task"].message
    for check in checks.values():
        assert "\n" not in check.message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_credentials_and_internet_urls(tmp_path: Path) -> None:
    checks = by_name(
        checks_for(
            f"run_dir={tmp_path}",
            "data.train=https://user:s3cret@example.org/index.json",
            "checkpoint.dir=s3://bucket/ckpt?X-Amz-Signature=s3cret",
        )
    )
    assert not checks["credentials"].ok and "s3cret" not in checks["credentials"].message
    assert checks["data.train offline"].warning
    assert "s3cret" not in format_checks(list(checks.values()))


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_empty_account_on_jean_zay_is_a_warning(tmp_path: Path) -> None:
    checks = by_name(checks_for(f"run_dir={tmp_path}", "data.train=x", profile="jean-zay-h100"))
    assert checks["profile"].ok and checks["profile"].warning
    assert "<project>@h100" in checks["profile"].message


@pytest.mark.slow  # a subprocess or worker processes: seconds, not the unit tier's ms
def test_preflight_verb_exit_status(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    code = main(["preflight", str(REPO / "configs" / "demo.yaml"), f"run_dir={tmp_path}",
                 f"data.train={tmp_path / 'nope'}", "--profile", "local-dev"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 6 and "FAIL data.train" in out and "ok   run_dir" in out


# -- the trainer's own checks, on the login node (issue #37 item 12) ---------------------


@pytest.fixture(scope="module")
def lm_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.support.lm_kit import write_token_shards

    root = tmp_path_factory.mktemp("lm")
    write_token_shards(root / "train", 1, seed=1)
    return root / "train" / "index.json"


def lm_checks(lm_data: Path, run_dir: Path, *extra: str, profile: str = "local-dev"):  # type: ignore[no-untyped-def]
    """The checks of a causal_lm job, all but the job's environment (a login shell each)."""
    overrides = [f"slurm.profile={profile}", f"run_dir={run_dir}", "task=causal_lm"]
    overrides += [f"data.train={lm_data}", "data.seq_len=32", *extra]
    cfg = with_overrides(Config(), overrides)
    return by_name(preflight(cfg, load_profile(profile), environment=False))


@pytest.mark.slow  # transformers builds the folders: seconds
def test_preflight_refuses_what_the_trainer_would_refuse_of_a_model(
    lm_data: Path, tmp_path: Path
) -> None:
    """An unsupported architecture, a .bin-only folder, a sliding window shorter than
    data.seq_len, a malformed RoPE entry, a preset the folder contradicts: each one FAIL
    line, as the trainer's own message (was: passed, then refused after the queue wait)."""
    import json

    pytest.importorskip("transformers")
    from tests.models.test_hf import save_hf

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    pickled = tmp_path / "pickled"
    save_hf(pickled, "llama", vocab_size=301)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    windowed = tmp_path / "mistral"
    save_hf(windowed, "mistral", vocab_size=301, sliding_window=8)
    llama = tmp_path / "llama"
    save_hf(llama, "llama", vocab_size=301)
    broken = tmp_path / "broken"
    save_hf(broken, "llama", vocab_size=301)
    config = json.loads((broken / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 5e5}
    (broken / "config.json").write_text(json.dumps(config))
    cases = {
        (f"model.init_from={gpt2}",): r"architectures \['GPT2LMHeadModel'\] is not supported",
        (f"model.init_from={pickled}",): r"PyTorch .bin weights only \(pytorch_model.bin\)",
        (f"model.init_from={windowed}",): r"^data.seq_len=32: longer than the sliding_window 8",
        (f"model.init_from={broken}",): r"config.json has no rope_parameters.low_freq_factor",
        (f"model.init_from={llama}", "model.name=gpt-1b"): r"^model.name=gpt-1b \(dim 2048",
    }
    for overrides, message in cases.items():
        checks = lm_checks(lm_data, tmp_path / "run", *overrides)
        model = checks.get("model") or checks["model.init_from"]
        assert not model.ok and re.search(message, model.message), (overrides, model.message)
    assert lm_checks(lm_data, tmp_path / "run", f"model.init_from={llama}")["model"].ok


@pytest.mark.slow  # builds a task per case: seconds
def test_preflight_checks_the_mesh_against_the_jobs_node_shape(
    lm_data: Path, tmp_path: Path
) -> None:
    """`train.tp_degree`/`train.shard_degree` the job's nodes do not divide, a
    `data.seq_len` the TP degree does not divide, a TP degree the model's heads do not take:
    refused on the login node with the trainer's own messages."""
    h100 = ("slurm.account=abc@h100", "train.strategy=fsdp")
    cases = {
        ("train.tp_degree=3", "data.seq_len=36"): r"train.tp_degree=3: must divide the 4 ranks",
        ("train.strategy=hsdp", "train.shard_degree=3", "slurm.nodes=2"): (
            r"train.shard_degree=3 does not divide the 8 data-parallel ranks"
        ),
        ("train.tp_degree=4", "data.seq_len=30"): r"data.seq_len=30: train.tp_degree=4 must",
    }
    for overrides, message in cases.items():
        checks = lm_checks(lm_data, tmp_path / "run", *h100, *overrides, profile="jean-zay-h100")
        assert not checks["train"].ok and re.search(message, checks["train"].message), overrides
    heads = lm_checks(
        lm_data, tmp_path / "run", *h100, "train.tp_degree=4", "causal_lm.n_heads=2",
        "causal_lm.dim=32", profile="jean-zay-h100",
    )  # fmt: skip
    assert heads["train"].ok and not heads["model"].ok
    assert "train.tp_degree=4: must divide causal_lm.n_heads=2" in heads["model"].message
    fine = lm_checks(lm_data, tmp_path / "run", *h100, "train.tp_degree=2", profile="jean-zay-h100")
    assert fine["train"].ok and "shard 2 x tp 2" in fine["train"].message, fine["train"].message


@pytest.mark.slow  # trains two steps: seconds
def test_preflight_of_a_run_that_resumes_does_not_need_its_init_from(
    lm_data: Path, tmp_path: Path
) -> None:
    """A run with checkpoints resumes: its `model.init_from` (gone since) is not read."""
    import shutil

    import torch

    from hpctrain.config import load_config
    from hpctrain.distributed import DistEnv
    from hpctrain.models.gpt import GPT, GPTConfig
    from hpctrain.train.trainer import Trainer

    weights = tmp_path / "start.pt"
    torch.save(
        GPT(
            GPTConfig(vocab_size=257, dim=32, n_layers=2, n_heads=4, tie_embeddings=True)
        ).state_dict(),
        weights,
    )
    run = ["task=causal_lm", f"data.train={lm_data}", "data.seq_len=32", "data.batch_size=2"]
    run += ["data.workers_per_rank=0", "causal_lm.dim=32", "causal_lm.n_layers=2"]
    run += ["causal_lm.n_heads=4", "train.max_steps=1", "train.precision=fp32"]
    run += [f"run_dir={tmp_path / 'run'}", f"model.init_from={weights}", "logging.progress=lines"]
    cfg = load_config(None, run)
    assert (
        Trainer(cfg, DistEnv(0, 0, 1, 1, "127.0.0.1", 0, "single"), torch.device("cpu")).fit() == 0
    )
    shutil.move(weights, tmp_path / "moved.pt")
    checks = by_name(
        preflight(
            with_overrides(cfg, ["slurm.profile=local-dev"]),
            load_profile("local-dev"),
            environment=False,
        )
    )
    assert checks["model.init_from"].ok and "not read, the run resumes from its step 1" in (
        checks["model.init_from"].message
    )
    assert checks["model"].ok and "resumes from step 1" in checks["model"].message


def test_preflight_refuses_a_job_larger_than_its_qos(tmp_path: Path) -> None:
    """Issue #37 item 20: the profile's per-job QoS limits are checked before the queue."""
    checks = by_name(
        checks_for(
            f"run_dir={tmp_path}",
            "data.train=x",
            "slurm.account=abc@v100",
            "slurm.qos=qos_gpu-t4",
            "slurm.nodes=5",
            profile="jean-zay-v100",
        )
    )
    assert not checks["profile"].ok
    assert "above the qos_gpu-t4 limit of 16 GPUs per job" in checks["profile"].message


# -- off the cluster: one line that says so, and what renders the script anyway (#43) ----


def path_without_sbatch(tmp_path: Path) -> str:
    """A PATH with bash but no SLURM commands, as on a laptop or a CI runner."""
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "bash").symlink_to(shutil.which("bash") or "/bin/bash")
    return str(folder)


def jean_zay_job(*overrides: str):  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), ["slurm.profile=jean-zay-a100", *overrides])
    return resolve_job(cfg, load_profile("jean-zay-a100"))


@pytest.mark.skipif(has_module_command(), reason="this machine has `module`: a login node")
def test_a_machine_without_the_module_command_is_not_a_login_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The profile's `module load` lines would each fail with `module: command not found`;
    one failed check says why instead, and the environment probe is not run."""
    check = check_login_node(jean_zay_job())
    assert check is not None and not check.ok
    assert check.message.startswith("this shell has no `module` command")
    assert "not a login node of jean-zay-a100" in check.message
    monkeypatch.setenv("PATH", path_without_sbatch(tmp_path))
    check = check_login_node(jean_zay_job())
    assert check is not None and "no `module` command" in check.message
    assert "and no `sbatch`" in check.message


def test_without_sbatch_a_profile_without_modules_gets_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = resolve_job(with_overrides(Config(), []), load_profile("generic"))
    assert check_login_node(job) is None  # sbatch is here, and no `module` line to run
    monkeypatch.setenv("PATH", path_without_sbatch(tmp_path))
    check = check_login_node(job)
    assert check is not None and check.ok and check.warning
    assert "no `sbatch`" in check.message and "can be rendered" in check.message


def test_the_failed_login_node_check_leads_the_error_with_what_to_do() -> None:
    checks = [
        Check("data.train", False, "/d/index.json: index not found"),
        Check(LOGIN_NODE, False, "this shell has no `module` command: not a login node of x"),
    ]
    with pytest.raises(LaunchError) as info:
        raise_if_failed(checks, "nothing written", off_cluster="--no-preflight renders it")
    assert str(info.value) == (
        "preflight failed, nothing written: login node: this shell has no `module` command: "
        "not a login node of x (--no-preflight renders it); data.train: /d/index.json: index not found"
    )


@pytest.mark.slow  # the whole preflight of a Jean Zay job: seconds
@pytest.mark.skipif(has_module_command(), reason="this machine has `module`: a login node")
def test_sbatch_off_the_cluster_says_so_in_one_line_and_names_no_preflight(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["sbatch", str(REPO / "configs" / "demo.yaml"), f"run_dir={tmp_path / 'run'}",
                 "slurm.account=abc@a100", "--profile", "jean-zay-a100"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 6 and captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(
        "hpctrain sbatch: launch error: preflight failed, nothing written: login node: this "
        "shell has no `module` command"
    )
    assert "(off the cluster, --no-preflight renders the script anyway)" in captured.err
    assert "command not found" not in captured.err
    # the preflight verb itself: the same first check, and what renders the script anyway
    code = main(["preflight", str(REPO / "configs" / "demo.yaml"), f"run_dir={tmp_path / 'run'}",
                 "slurm.account=abc@a100", "--profile", "jean-zay-a100", "--no-data"])  # fmt: skip
    captured = capsys.readouterr()
    assert code == 6 and "FAIL login node: this shell has no `module` command" in captured.out
    # first, with what to do; other failures may follow (a local cluster's sacctmgr: no QoS)
    assert captured.err.startswith("hpctrain preflight: launch error: preflight failed: login node")
    first = captured.err.rstrip("\n").split("; ", 1)[0]
    assert first.endswith("(off the cluster, sbatch --no-preflight renders the script anyway)")
    assert "command not found" not in captured.out + captured.err


def test_preflight_checks_the_run_folder_under_the_profiles_run_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`hpctrain preflight` places a relative run_dir as `sbatch` and `submit` do (#43) and
    its run_dir line names that folder, not one in the clone."""
    clone = tmp_path / "clone"
    clone.mkdir()
    monkeypatch.chdir(clone)
    monkeypatch.setenv("HOME", str(tmp_path))  # the generic profile's run_root: $HOME/hpctrain
    main(["preflight", str(REPO / "configs" / "demo.yaml"), "--profile", "generic", "--no-data"])
    run = tmp_path / "hpctrain" / "runs" / "demo"
    assert f"ok   run_dir: {run} writable" in capsys.readouterr().out
    assert run.is_dir() and list(clone.iterdir()) == []
