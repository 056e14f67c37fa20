"""Cluster profiles: every shipped profile loads; limits are enforced with one-line errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.config import Config, with_overrides
from hpctrain.launch.profiles import (
    LaunchError,
    available_profiles,
    load_profile,
    parse_profile,
    parse_time,
    resolve_job,
)

SHIPPED = ["generic", "jean-zay-a100", "jean-zay-h100", "jean-zay-v100", "local-dev"]


def job_for(profile: str, *overrides: str):  # type: ignore[no-untyped-def]
    cfg = with_overrides(Config(), [f"slurm.profile={profile}", *overrides])
    return resolve_job(cfg, load_profile(profile))


def test_shipped_profiles_load_and_resolve_with_defaults() -> None:
    assert set(SHIPPED) <= set(available_profiles())
    for name in SHIPPED:
        job = job_for(name)
        assert job.tasks_per_node >= 1 and job.cpus_per_task >= 1 and job.time_minutes > 0


def test_jean_zay_profiles_hold_the_idris_facts() -> None:
    v100, a100, h100 = (load_profile(f"jean-zay-{g}") for g in ("v100", "a100", "h100"))
    assert v100.partitions["gpu_p13"].constraint == "v100-32g"
    assert v100.partitions["gpu_p13"].gpus_per_node == 4
    assert a100.partitions["gpu_p5"].constraint == "a100"
    assert a100.partitions["gpu_p5"].gpus_per_node == 8
    assert h100.partitions["gpu_p6"].constraint == "h100"
    assert h100.partitions["gpu_p6"].gpus_per_node == 4
    assert v100.qos_max_minutes == {"qos_gpu-t3": 1200, "qos_gpu-t4": 6000, "qos_gpu-dev": 120}
    assert "bf16" not in v100.precisions and "bf16" in a100.precisions
    assert {p.account_suffix for p in (v100, a100, h100)} == {"@v100", "@a100", "@h100"}
    assert all(p.hint == "nomultithread" for p in (v100, a100, h100))


# The site's QoS names per partition (issue 29: the A100 and H100 profiles once carried the V100
# names, and every job they gave was rejected). Sources are in each profile's comments;
# preflight's live `sacctmgr` check stays the final word.
JEAN_ZAY_QOS = {
    "jean-zay-v100": ("qos_gpu-t3", {"qos_gpu-t3": 1200, "qos_gpu-t4": 6000, "qos_gpu-dev": 120}),
    "jean-zay-a100": ("qos_gpu_a100-t3", {"qos_gpu_a100-t3": 1200, "qos_gpu_a100-dev": 120}),
    "jean-zay-h100": (
        "qos_gpu_h100-t3",
        {"qos_gpu_h100-t3": 1200, "qos_gpu_h100-t4": 6000, "qos_gpu_h100-dev": 120},
    ),
}


@pytest.mark.parametrize("name", sorted(JEAN_ZAY_QOS))
def test_jean_zay_profiles_carry_the_sites_qos_names(name: str) -> None:
    default, limits = JEAN_ZAY_QOS[name]
    profile = load_profile(name)
    assert profile.qos_max_minutes == limits
    assert profile.default_qos == default
    assert all(set(p.qos) <= set(limits) for p in profile.partitions.values())
    job = job_for(name)
    assert job.qos == default and job.time_minutes <= limits[default]
    for qos, minutes in limits.items():  # each QoS takes its own limit, and not a minute more
        assert job_for(name, f"slurm.qos={qos}", f"slurm.time={minutes}").qos == qos
        with pytest.raises(LaunchError, match=f"above the {qos} limit"):
            job_for(name, f"slurm.qos={qos}", f"slurm.time={minutes + 1}")


def test_jean_zay_profiles_cite_their_sources() -> None:
    for name in JEAN_ZAY_QOS:
        text = Path(load_profile(name).source).read_text()
        assert "Sources of each fact" in text and "idris.fr" in text
        assert "NOT CONFIRMED" in text  # what no public source showed is marked as such


def test_overrides_replace_profile_values() -> None:
    job = job_for(
        "jean-zay-v100",
        "slurm.account=abc@v100",
        "slurm.nodes=3",
        "slurm.gpus_per_node=2",
        "slurm.qos=qos_gpu-dev",
        "slurm.time='01:30:00'",
        "slurm.partition=gpu_p2",
    )
    assert (job.account, job.nodes, job.tasks_per_node, job.gpus_per_node) == ("abc@v100", 3, 2, 2)
    assert (job.qos, job.time, job.partition, job.constraint) == (
        "qos_gpu-dev",
        "01:30:00",
        "gpu_p2",
        "",
    )


@pytest.mark.parametrize(
    ("profile", "overrides", "expected"),
    [
        (
            "jean-zay-a100",
            ["slurm.time='30:00:00'"],
            "above the qos_gpu_a100-t3 limit of 20:00:00",
        ),
        ("jean-zay-v100", ["slurm.qos=qos_gpu-dev", "slurm.time=180"], "qos_gpu-dev ≤ 02:00:00"),
        (
            "jean-zay-a100",
            ["slurm.qos=qos_gpu_a100-t4"],
            "allows qos_gpu_a100-t3, qos_gpu_a100-dev",
        ),
        ("jean-zay-h100", ["slurm.qos=qos_gpu-t3"], "allows qos_gpu_h100-t3, qos_gpu_h100-t4"),
        ("jean-zay-h100", ["slurm.gpus_per_node=8"], "allowed: 1-4"),
        ("jean-zay-v100", ["train.precision=bf16"], "allowed: auto, fp32, fp16"),
        ("jean-zay-a100", ["slurm.account=abc@v100"], "<project>@a100"),
        ("jean-zay-a100", ["slurm.partition=gpu_p13"], "has gpu_p5"),
        ("local-dev", ["slurm.time=1", "slurm.signal_margin_s=90"], "below the wall time"),
    ],
)
def test_violations_are_one_line_errors_with_allowed_values(
    profile: str, overrides: list[str], expected: str
) -> None:
    with pytest.raises(LaunchError) as info:
        job_for(profile, *overrides)
    assert expected in str(info.value)
    assert "\n" not in str(info.value)


def test_unknown_profile_lists_the_available_ones() -> None:
    with pytest.raises(LaunchError, match="available: .*jean-zay-a100"):
        load_profile("jean-zay-x")
    with pytest.raises(LaunchError, match="not a profile name"):
        load_profile("../etc/passwd")


def test_profile_file_errors_name_the_file_and_key() -> None:
    good = {
        "name": "x",
        "default_partition": "p",
        "partitions": {"p": {"gpus_per_node": 4, "cpus_per_task": 8, "qos": ["q"]}},
        "qos": {"q": "01:00:00"},
        "default_time": "10",
        "precisions": ["fp32"],
    }
    assert parse_profile(good, "x.yaml").partitions["p"].qos == ("q",)
    with pytest.raises(LaunchError, match=r"x.yaml: unknown key 'gpus'"):
        parse_profile({**good, "gpus": 4}, "x.yaml")
    with pytest.raises(LaunchError, match=r"partitions.p lists QoS 'z'"):
        parse_profile(
            {**good, "partitions": {"p": {"gpus_per_node": 4, "cpus_per_task": 8, "qos": ["z"]}}},
            "x.yaml",
        )
    with pytest.raises(LaunchError, match="missing key 'default_time'"):
        parse_profile({k: v for k, v in good.items() if k != "default_time"}, "x.yaml")
    # the driver's CUDA, quoted: YAML reads 12.10 as the number 12.1
    assert parse_profile({**good, "driver_cuda": "12.10"}, "x.yaml").driver_cuda == "12.10"
    with pytest.raises(LaunchError, match=r"x.yaml: driver_cuda=12.1 is not a quoted version"):
        parse_profile({**good, "driver_cuda": 12.1}, "x.yaml")
    with pytest.raises(LaunchError, match=r"driver_cuda='cu126' is not a quoted version"):
        parse_profile({**good, "driver_cuda": "cu126"}, "x.yaml")


@pytest.mark.parametrize(
    ("text", "minutes"),
    [("10", 10), ("90:30", 91), ("20:00:00", 1200), ("1-00", 1440), ("2-03:04:05", 3065)],
)
def test_parse_time_reads_slurm_forms(text: str, minutes: int) -> None:
    assert parse_time(text) == minutes


@pytest.mark.parametrize("text", ["", "1h", "0", "12:xx", "-1"])
def test_parse_time_refuses_other_forms(text: str) -> None:
    with pytest.raises(LaunchError, match="slurm.time"):
        parse_time(text)


@pytest.mark.parametrize(
    ("profile", "overrides", "message"),
    [
        (
            "jean-zay-v100",
            ("slurm.qos=qos_gpu-t4", "slurm.nodes=5"),
            r"^slurm.nodes=5 x 4 GPUs = 20 GPUs: above the qos_gpu-t4 limit of 16 GPUs per job "
            r"on jean-zay-v100; slurm.qos=qos_gpu-t3 \(≤ 512 GPUs, 20:00:00\) takes it$",
        ),
        (
            "jean-zay-v100",
            ("slurm.qos=qos_gpu-dev", "slurm.partition=gpu_p2", "slurm.nodes=5"),
            r"^slurm.nodes=5 x 8 GPUs = 40 GPUs: above the qos_gpu-dev limit of 32 GPUs",
        ),
        (
            "jean-zay-v100",
            ("slurm.nodes=129",),
            r"above the qos_gpu-t3 limit of 512 GPUs per job on jean-zay-v100$",
        ),
        (
            "jean-zay-h100",
            ("slurm.qos=qos_gpu_h100-t4", "slurm.nodes=17"),
            r"= 68 GPUs: above the qos_gpu_h100-t4 limit of 64 GPUs per job",
        ),
    ],
    ids=["v100-t4", "v100-dev-gpu_p2", "v100-t3", "h100-t4"],
)
def test_a_job_larger_than_its_qos_allows_is_refused(
    profile: str, overrides: tuple, message: str
) -> None:
    """Issue #37 item 20: SLURM queues such a job and never starts it (QOSMaxGRESPerJob)."""
    with pytest.raises(LaunchError, match=message) as info:
        job_for(profile, *overrides)
    assert "\n" not in str(info.value)


def test_jobs_within_their_qos_limits_resolve_and_the_limits_cite_a_source() -> None:
    assert job_for("jean-zay-v100", "slurm.qos=qos_gpu-t4", "slurm.nodes=4").nodes == 4
    assert job_for("jean-zay-h100", "slurm.qos=qos_gpu_h100-dev", "slurm.nodes=8").nodes == 8
    assert job_for("jean-zay-a100", "slurm.nodes=64").nodes == 64  # no public limit: unchecked
    for name, limits in {
        "jean-zay-v100": {"qos_gpu-t3": 512, "qos_gpu-t4": 16, "qos_gpu-dev": 32},
        "jean-zay-h100": {"qos_gpu_h100-t3": 512, "qos_gpu_h100-t4": 64, "qos_gpu_h100-dev": 32},
        "jean-zay-a100": {},
    }.items():
        profile = load_profile(name)
        assert profile.qos_max_gpus == limits
        text = Path(profile.source).read_text()
        assert "GPUs one job may hold per QoS" in text  # each says where its numbers are from
    with pytest.raises(LaunchError, match=r"x.yaml: qos_max_gpus.q=0: a QoS of `qos`"):
        parse_profile(
            {
                "name": "x",
                "default_partition": "p",
                "partitions": {"p": {"gpus_per_node": 4, "cpus_per_task": 8, "qos": ["q"]}},
                "qos": {"q": "01:00:00"},
                "qos_max_gpus": {"q": 0},
                "default_time": "10",
                "precisions": ["fp32"],
            },
            "x.yaml",
        )


def test_a_profile_s_node_local_dir_reaches_every_task_of_the_job(tmp_path: Path) -> None:
    text = (Path(load_profile("local-dev").source).read_text()).replace(
        "name: local-dev", "name: shm-dev\nnode_local_dir: $TMPDIR/hpctrain"
    )
    (tmp_path / "shm-dev.yaml").write_text(text)
    profile = load_profile(str(tmp_path / "shm-dev.yaml"))
    job = resolve_job(with_overrides(Config(), ["slurm.profile=shm-dev"]), profile)
    assert job.setup[0] == "export HPCTRAIN_NODE_LOCAL_DIR='$TMPDIR/hpctrain'"
    assert not any("NODE_LOCAL" in line for line in job_for("local-dev").setup)
    (tmp_path / "bad.yaml").write_text(text.replace("$TMPDIR/hpctrain", '"/tmp/x\'; rm -rf /"'))
    with pytest.raises(LaunchError, match="node_local_dir=.*not a folder path"):
        load_profile(str(tmp_path / "bad.yaml"))


def test_a_profile_s_fabric_interface_reaches_every_task_of_the_job(tmp_path: Path) -> None:
    """`fabric_interface: ib0` (#50): the tasks' rendezvous store, gloo and the probe use it."""
    from hpctrain.launch.sbatch import environment_lines

    text = (Path(load_profile("local-dev").source).read_text()).replace(
        "name: local-dev", "name: ib-dev\nfabric: infiniband\nfabric_interface: ib0"
    )
    (tmp_path / "ib-dev.yaml").write_text(text)
    job = resolve_job(
        with_overrides(Config(), ["slurm.profile=ib-dev"]),
        load_profile(str(tmp_path / "ib-dev.yaml")),
    )
    lines = environment_lines(job)
    assert "export HPCTRAIN_FABRIC=infiniband" in "\n".join(lines)
    assert any(line.startswith("export HPCTRAIN_FABRIC_INTERFACE=ib0  #") for line in lines)
    assert not any(
        "FABRIC_INTERFACE" in line for line in environment_lines(job_for("jean-zay-h100"))
    )
    (tmp_path / "bad.yaml").write_text(text.replace("ib0", '"ib0; rm -rf /"'))
    with pytest.raises(
        LaunchError, match="fabric_interface='ib0; rm -rf /' is not a network interface"
    ):
        load_profile(str(tmp_path / "bad.yaml"))
