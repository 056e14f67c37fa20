import dataclasses
from pathlib import Path

import pytest
import torch

from hpctrain.config import (
    ConfigError,
    config_from_dict,
    config_to_dict,
    config_to_yaml,
    load_config,
    with_overrides,
)
from hpctrain.config.load import reference_rows

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_defaults_and_file_and_override(tmp_path: Path) -> None:
    path = write(tmp_path, "seed: 3\ndata:\n  batch_size: 16\ntrain:\n  strategy: fsdp\n")
    cfg = load_config(
        path, ["train.max_steps=7", "data.train=/x/index.json", "checkpoint.async=true"]
    )
    assert cfg.seed == 3
    assert cfg.data.batch_size == 16
    assert cfg.train.strategy == "fsdp"
    assert cfg.train.max_steps == 7
    assert cfg.data.train == "/x/index.json"
    assert cfg.checkpoint.async_save is True
    assert cfg.train.lr == pytest.approx(1e-3)


@pytest.mark.parametrize(
    ("override", "fragment"),
    [
        ("data.batch_size=-1", "data.batch_size=-1 (command line): must be >= 1"),
        ("train.strategy=foo", "train.strategy='foo' (command line): must be one of none|ddp|fsdp"),
        ("train.precision=fp8", "must be one of auto|fp32|bf16|fp16"),
        ("train.max_steps=abc", "train.max_steps='abc' (command line): expected an integer"),
        ("train.nope=1", "unknown key 'train.nope' (command line)"),
        ("data.pin_memory=3", "expected true or false"),
        ("nokey", "expected key.sub=value"),
        ("train=3", "train=3 (command line): expected a mapping"),
    ],
)
def test_bad_overrides_name_the_key(override: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert fragment in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_file_value_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  workers_per_rank: -2\n")
    with pytest.raises(ConfigError, match=rf"data.workers_per_rank=-2 \({path}\): must be >= 0"):
        load_config(path)


def test_unknown_file_key_lists_allowed(tmp_path: Path) -> None:
    path = write(tmp_path, "data:\n  batchsize: 3\n")
    with pytest.raises(
        ConfigError, match=r"unknown key 'data.batchsize' .*allowed here: .*batch_size"
    ):
        load_config(path)


def test_invalid_yaml_and_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(write(tmp_path, "a: [1,\n"))
    with pytest.raises(ConfigError, match="cannot read config file"):
        load_config(tmp_path / "missing.yaml")


def test_yaml_round_trip_is_identity() -> None:
    cfg = load_config(
        REPO / "configs" / "demo.yaml", ["checkpoint.async=true", "slurm.setup=[module load x]"]
    )
    assert load_config_from_yaml(config_to_yaml(cfg)) == cfg
    assert config_from_dict(config_to_dict(cfg)) == cfg


def load_config_from_yaml(text: str):  # type: ignore[no-untyped-def]
    import yaml

    return config_from_dict(yaml.safe_load(text))


def test_with_overrides_validates() -> None:
    cfg = load_config(None, [])
    assert with_overrides(cfg, ["train.max_steps=3"]).train.max_steps == 3
    with pytest.raises(ConfigError):
        with_overrides(cfg, ["train.max_steps=-3"])


def test_every_key_has_help() -> None:
    rows = reference_rows()
    keys = {key for key, _, _ in rows}
    for required in (
        "run_dir",
        "seed",
        "data.train",
        "data.val",
        "data.batch_size",
        "data.workers_per_rank",
        "train.max_steps",
        "train.strategy",
        "train.precision",
        "checkpoint.every_steps",
        "checkpoint.keep_last",
        "checkpoint.async",
    ):
        assert required in keys
    assert all(help_text for _, _, help_text in rows)


def test_times_stay_text_and_exponents_are_numbers(tmp_path: Path) -> None:
    """YAML 1.1 would read 20:00:00 as 72000 (base 60), which SLURM takes as minutes."""
    path = write(tmp_path, "slurm:\n  time: 20:00:00\ntrain:\n  lr: 1e-3\n")
    cfg = load_config(path, [])
    assert cfg.slurm.time == "20:00:00"
    assert cfg.train.lr == pytest.approx(1e-3)
    assert load_config(None, ["slurm.time=1:30:00", "train.lr=3e-4"]).slurm.time == "1:30:00"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("train:\n  lr: 0.1\nseed: 1\ntrain:\n  max_steps: 4\n", "'train' at lines 1 and 4"),
        ("train:\n  lr: 0.1\n  lr: 0.2\n", "'train.lr' at lines 2 and 3"),
        ("data:\n  train:\n  - {path: a, weight: 1, weight: 2}\n", "'data.train[0].weight'"),
    ],
)
def test_a_duplicate_key_is_refused_naming_it_and_both_lines(
    tmp_path: Path, text: str, fragment: str
) -> None:
    """PyYAML keeps the last value: a second `train:` block would replace the first."""
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=rf"^{path}: duplicate key ") as err:
        load_config(path)
    assert fragment in str(err.value)
    with pytest.raises(ConfigError, match=r"\(command line\): duplicate key 'a' at lines 1 and 1"):
        load_config(None, ["task_options={a: 1, a: 2}"])


def test_a_merge_key_may_still_override(tmp_path: Path) -> None:
    path = write(tmp_path, "task_options:\n  base: &b {x: 1, y: 2}\n  run: {<<: *b, x: 3}\n")
    assert load_config(path).task_options["run"] == {"x": 3, "y": 2}


def test_string_keys_keep_the_text_yaml_1_1_would_read_as_a_bool_date_or_number(
    tmp_path: Path,
) -> None:
    """`logging.wandb: off` is the documented value, not False; `slurm.qos=yes` not True."""
    path = write(
        tmp_path,
        "logging:\n  wandb: off\n  run_name: 2024-01-01\nslurm:\n  qos: yes\n  account: 0123\n"
        "  setup: [on, 1.50]\ndata:\n  pin_memory: off\ntask_options: {a: yes, b: 0x10}\n",
    )
    cfg = load_config(path)
    assert cfg.logging.wandb == "off" and cfg.logging.run_name == "2024-01-01"
    assert cfg.slurm.qos == "yes" and cfg.slurm.account == "0123"
    assert cfg.slurm.setup == ["on", "1.50"]
    assert cfg.data.pin_memory is False  # a bool key still reads YAML's booleans
    assert cfg.task_options == {"a": True, "b": 16}  # free-form: the values YAML reads
    cfg = load_config(
        None, ["slurm.qos=yes", "logging.run_name=2024-01-01", "logging.wandb=off", "seed=0x10"]
    )
    assert (cfg.slurm.qos, cfg.logging.run_name, cfg.logging.wandb) == ("yes", "2024-01-01", "off")
    assert cfg.seed == 16
    assert load_config_from_yaml(config_to_yaml(cfg)) == cfg  # saved quoted, read back as text
    with pytest.raises(ConfigError, match=r"^train.lr=True \(command line\): expected a number"):
        load_config(None, ["train.lr=yes"])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"logging:\n  run_name: caf\xe9\n", "line 2: not UTF-8 text (byte 0xe9)"),
        (b"a.yaml" + b"\0" * 100 + b"0000644\0", "not a text file (it holds NUL bytes)"),
        (b"#" * (4 * 2**20 + 1), "larger than 4 MiB"),
    ],
)
def test_a_file_that_is_no_config_text_is_one_line(
    tmp_path: Path, content: bytes, fragment: str
) -> None:
    """A Latin-1 config, a tar file given as the config, a huge file: not a traceback."""
    path = tmp_path / "run.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError, match=rf"^{path}") as err:
        load_config(path)
    assert fragment in str(err.value)


def test_an_endless_file_is_read_up_to_the_cap() -> None:
    with pytest.raises(ConfigError, match=r"^/dev/zero: larger than 4 MiB"):
        load_config("/dev/zero")


def test_a_utf8_byte_order_mark_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "run.yaml"
    path.write_bytes("\ufeffseed: 3\nlogging:\n  run_name: café\n".encode())
    cfg = load_config(path)
    assert (cfg.seed, cfg.logging.run_name) == (3, "café")


def alias_bomb(levels: int = 9) -> str:
    """A few hundred bytes of YAML that expand to 9**levels values (the billion laughs)."""
    lines = ['l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"  l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 9)}]" for i in range(1, levels)]
    return "task_options:\n  " + "\n  ".join(line.strip() for line in lines) + "\n"


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("task_options: {x: " + "[" * 5000 + "]" * 5000 + "}\n", "nested deeper than 100 levels"),
        (alias_bomb(), "more than 100000 values once its aliases are expanded"),
        ("task_options: &x {a: [*x]}\n", "an alias inside the node it names"),
        # each part is shallow; the aliases make it 120 levels deep
        (
            "task_options:\n  a: &a "
            + "[" * 60
            + "]" * 60
            + "\n  b: "
            + "[" * 60
            + "*a"
            + "]" * 60
            + "\n",
            "nested deeper than 100 levels",
        ),
    ],
)
def test_too_deep_or_too_large_yaml_is_refused_before_anything_else(
    tmp_path: Path, text: str, fragment: str
) -> None:
    """Were a RecursionError and, for a 900-byte alias bomb, 20 s then a MemoryError."""
    path = write(tmp_path, text + "nokey: 1\n")  # refused before the unknown key is reported
    with pytest.raises(ConfigError, match=rf"^{path}: ") as err:
        load_config(path)
    assert fragment in str(err.value)


def test_too_deep_an_override_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"^override .* \(command line\): nested deeper"):
        load_config(None, ["task_options={x: " + "[" * 5000 + "]" * 5000 + "}"])


MIXTURE = (
    "data:\n  train:\n  - {path: a/index.json, weight: 2}\n"
    "  - {path: b/index.json, weight: 1, name: b}\n"
)


def test_an_override_sets_a_key_of_a_list_item(tmp_path: Path) -> None:
    """`data.train[0].weight=3`, the form error messages print, sweeps a mixture weight."""
    path = write(tmp_path, MIXTURE)
    cfg = load_config(path, ["data.train[0].weight=3", "data.train[1].name=bb"])
    assert not isinstance(cfg.data.train, str)
    assert [(s.weight, s.name) for s in cfg.data.train] == [(3.0, ""), (1.0, "bb")]
    again = with_overrides(cfg, ["data.train[1].weight=0.5"])  # a resolved config too
    assert not isinstance(again.data.train, str)
    assert [s.weight for s in again.data.train] == [3.0, 0.5]


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "data.train[2].weight=3",
            "override 'data.train[2].weight=3' (command line): data.train has 2 items, so no "
            "item 2",
        ),
        (
            "data.train.0.weight=3",
            "override 'data.train.0.weight=3' (command line): data.train is a list; name an "
            "item as in data.train[0].weight=3",
        ),
        ("data.train[0].wieght=3", "unknown key 'data.train[0].wieght' (command line)"),
        ("data.train[0].weight=x", "data.train[0].weight='x' (command line): expected a number"),
        ("data.val[0].path=x", "override 'data.val[0].path=x' (command line): data.val is not"),
        ("nope.x=1", "unknown key 'nope' (command line)"),
        ("train={lr: -1}", "train.lr=-1.0 (command line): must be >= 0.0"),
    ],
)
def test_a_bad_override_is_blamed_on_the_command_line(
    tmp_path: Path, override: str, message: str
) -> None:
    """Were "unknown key ... (defaults)" or blamed on the file."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MIXTURE), [override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("data.train[1].weight=0", "data.train[1].weight=0.0 (command line): must be > 0"),
        ("data.train[0].weight=-2", "data.train[0].weight=-2.0 (command line): must be > 0"),
        (
            "data.samples_per_epoch=3000000001",
            "data.samples_per_epoch=3000000001 (command line): must be <= 3000000000 (the "
            "largest epoch a mixture plans)",
        ),
    ],
)
def test_mixture_values_the_plan_refuses_are_config_errors(
    tmp_path: Path, override: str, message: str
) -> None:
    """Were accepted here and refused once the data was opened (a data error, exit 3)."""
    with pytest.raises(ConfigError) as err:
        load_config(write(tmp_path, MIXTURE), [override])
    assert str(err.value) == message
    assert load_config(None, ["data.samples_per_epoch=3000000000"]).data.samples_per_epoch


def test_the_largest_samples_per_epoch_is_the_plans() -> None:
    from hpctrain.config.schema import DataConfig
    from hpctrain.data.mixture import MAX_SLOTS

    (f,) = [f for f in dataclasses.fields(DataConfig) if f.name == "samples_per_epoch"]
    assert f.metadata["max"] == MAX_SLOTS


@pytest.mark.parametrize(
    ("checkpoint_dir", "root"),
    [
        ("", "runs/x/checkpoints"),
        ("ckpts", "runs/x/ckpts"),
        ("../shared/ckpts", "runs/x/../shared/ckpts"),
        ("/store/ckpts", "/store/ckpts"),
        ("s3://bucket/ckpts", "s3://bucket/ckpts"),
        ("$SCRATCH/ckpts", "$SCRATCH/ckpts"),
    ],
)
def test_a_relative_checkpoint_dir_is_under_the_run_folder(checkpoint_dir: str, root: str) -> None:
    """Not under the current directory, which eval, export or a requeued job may not share."""
    cfg = load_config(None, ["run_dir=runs/x", f"checkpoint.dir={checkpoint_dir}"])
    assert cfg.checkpoint_root() == root


@pytest.mark.parametrize("word", ["nan", "inf", "-inf", "NaN", "Infinity", ".nan", ".inf", "1e999"])
def test_every_spelling_of_nan_and_inf_is_not_a_finite_number(word: str) -> None:
    """`nan`/`inf` said "expected a number", `.nan`/`.inf`/`1e999` "expected a finite number"."""
    with pytest.raises(
        ConfigError, match=r"^train.lr=.* \(command line\): expected a finite number$"
    ):
        load_config(None, [f"train.lr={word}"])


def test_the_gpt_shape_keys_moved_to_causal_lm_and_the_old_ones_still_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write(tmp_path, "task: causal_lm\nmodel:\n  name: gpt-tiny\n  dim: 64\n")
    cfg = load_config(path, ["model.n_heads=2", "causal_lm.n_layers=3"])
    assert (cfg.causal_lm.dim, cfg.causal_lm.n_heads, cfg.causal_lm.n_layers) == (64, 2, 3)
    warned = [r.getMessage() for r in caplog.records]
    assert f"model.dim ({path}) is deprecated: it is now causal_lm.dim" in warned
    assert "model.n_heads (command line) is deprecated: it is now causal_lm.n_heads" in warned
    assert "dim" not in config_to_dict(cfg)["model"]  # saved configs hold the new keys only
    caplog.clear()
    old_saved = config_to_dict(cfg)
    old_saved["model"].update(old_saved.pop("causal_lm"))  # a run of an older hpctrain
    assert config_from_dict(old_saved).causal_lm == cfg.causal_lm
    assert with_overrides(cfg, ["model.dim=32"]).causal_lm.dim == 32
    both = write(tmp_path, "model:\n  dim: 64\ncausal_lm:\n  dim: 32\n")
    with pytest.raises(ConfigError, match=r"^model.dim and causal_lm.dim are both set \("):
        load_config(both)
    caplog.clear()
    load_config(write(tmp_path, "model:\n  dim: 0\n  tie_embeddings: null\n"))
    assert not caplog.records  # at their defaults (an older resolved config): no warning


def test_a_sequence_length_tensor_parallelism_cannot_split_is_refused_on_load(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # #37 item 13: each TP rank takes an equal part of every sequence (sequence parallelism);
    # 30 tokens on 4 ranks aborted the first step in gloo (SIGABRT), after the queue wait.
    from hpctrain.cli.main import main
    from hpctrain.config import config_from_dict
    from hpctrain.distributed import resolve_env
    from hpctrain.train.trainer import Trainer

    config = tmp_path / "lm.yaml"
    config.write_text("task: causal_lm\ndata:\n  seq_len: 30\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, ["train.strategy=fsdp", "train.tp_degree=4"])
    assert str(info.value) == (
        f"data.seq_len=30 ({config}): train.tp_degree=4 (command line) must divide it (tensor "
        "parallelism splits every sequence into 4 equal parts): use 28 or 32"
    )
    with pytest.raises(ConfigError, match=r"data.seq_len=3 \(command line\): .* use 4$"):
        load_config(None, ["data.seq_len=3", "train.tp_degree=4"])
    load_config(None, ["data.seq_len=32", "train.tp_degree=4"])  # divides: fine
    load_config(None, ["data.seq_len=31"])  # no tensor parallelism: any length
    # preflight (so submit and sbatch) loads the config the same way: refused on the login node
    code = main(["preflight", str(config), "train.tp_degree=4", "--profile", "local-dev"])
    assert (
        code == 2 and "train.tp_degree=4 (command line) must divide it" in capsys.readouterr().err
    )
    # a config built in code (submitit pickles one) meets the rule at the trainer's start
    built = config_from_dict(
        {"task": "causal_lm", "data": {"seq_len": 30}, "train": {"tp_degree": 4}}
    )
    with pytest.raises(ConfigError, match="data.seq_len=30: train.tp_degree=4 must divide it"):
        Trainer(built, resolve_env({}), torch.device("cpu"))


def test_the_timeouts_must_rise_from_the_heartbeat_to_the_signal_lead(tmp_path: Path) -> None:
    """heartbeat < collective < step < save < signal lead (#47): a rank's watcher must see its
    heartbeat stop before its peers' collectives give up on it (it names the hung rank), a
    collective must time out before the step deadline ends a rank waiting in it (which would
    read as that rank's own failure), and a save must fit in the signal's lead."""
    from hpctrain.config.rules import describe_timeouts

    config = tmp_path / "c.yaml"
    config.write_text("train:\n  collective_timeout_s: 20\n")
    with pytest.raises(ConfigError) as info:
        load_config(config, [])
    assert str(info.value) == (
        f"train.heartbeat_timeout_s=30 must be below train.collective_timeout_s=20 ({config}): "
        "the timeouts fire from the finest to the coarsest (train.heartbeat_timeout_s < "
        "train.collective_timeout_s < train.step_timeout_s < checkpoint.save_timeout_s < "
        "slurm.signal_margin_s; 0: off or learnt)"
    )
    load_config(config, ["train.heartbeat_timeout_s=10"])  # below it: fine
    load_config(config, ["train.heartbeat_timeout_s=0"])  # off: nothing to compare
    with pytest.raises(ConfigError, match=r"^train.collective_timeout_s=600 must be below "
                       r"train.step_timeout_s=60 \(command line\)"):  # fmt: skip
        load_config(None, ["train.step_timeout_s=60"])
    with pytest.raises(ConfigError, match=r"^checkpoint.save_timeout_s=300 \(command line\) "
                       r"must be below slurm.signal_margin_s=120"):  # fmt: skip
        load_config(None, ["checkpoint.save_timeout_s=300"])
    load_config(None, ["checkpoint.save_timeout_s=300", "slurm.signal_margin_s=400"])
    # the defaults keep the order, and the start-up line says it
    assert describe_timeouts(load_config(None, [])) == (
        "timeouts: heartbeat max(30 s, 5 x slowest recent step) < collective 600 s < step off "
        "< save learnt < signal lead 120 s (docs/clusters.md, timeouts)"
    )


def test_every_minutes_takes_minutes_or_the_word_auto(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, "checkpoint:\n  every_minutes: auto\n"))
    assert cfg.checkpoint.every_minutes == "auto"
    assert config_from_dict(config_to_dict(cfg)).checkpoint.every_minutes == "auto"
    assert "every_minutes: auto" in config_to_yaml(cfg)
    assert with_overrides(cfg, ["checkpoint.every_minutes=30"]).checkpoint.every_minutes == 30.0
    with pytest.raises(
        ConfigError, match=r"every_minutes='soon' \(command line\): expected float \| 'auto'"
    ):
        load_config(None, ["checkpoint.every_minutes=soon"])
    with pytest.raises(ConfigError, match=r"every_minutes=-1.0 \(command line\): must be >= 0.0"):
        load_config(None, ["checkpoint.every_minutes=-1"])


def test_fsdp2_as_the_docs_write_it_is_fsdp() -> None:
    for spelling in ("fsdp2", "FSDP2", "fsdp"):
        assert load_config(None, [f"train.strategy={spelling}"]).train.strategy == "fsdp"


def test_a_misspelt_key_or_value_gets_a_did_you_mean() -> None:
    with pytest.raises(
        ConfigError,
        match=r"^unknown key 'train\.max_step' \(command line\): did you mean "
        r"'train\.max_steps'\? allowed here: ",
    ):
        load_config(None, ["train.max_step=3"])
    with pytest.raises(
        ConfigError,
        match=r"^train\.strategy='fdsp' \(command line\): must be one of none\|ddp\|fsdp\|hsdp; "
        r"did you mean 'fsdp'\?$",
    ):
        load_config(None, ["train.strategy=fdsp"])
    with pytest.raises(ConfigError, match=r"must be one of none\|ddp\|fsdp\|hsdp$"):
        load_config(None, ["train.strategy=zzz"])  # nothing close: no guess
