import pytest

from hpctrain.distributed import expand_hostlist, port_from_job_id, resolve_env


@pytest.mark.parametrize(
    ("text", "hosts"),
    [
        ("node1", ["node1"]),
        ("jz[001-003,010],jzb5", ["jz001", "jz002", "jz003", "jz010", "jzb5"]),
        ("a[1-2]b[3-4]", ["a1b3", "a1b4", "a2b3", "a2b4"]),
        ("r1i0n[8-10]", ["r1i0n8", "r1i0n9", "r1i0n10"]),
        ("x[09-11]", ["x09", "x10", "x11"]),
        ("n1,n2", ["n1", "n2"]),
        ("gpu-[1,3]", ["gpu-1", "gpu-3"]),
    ],
)
def test_expand_hostlist(text: str, hosts: list[str]) -> None:
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("bad", ["jz[1-", "jz1]", "jz[a-b]", "jz[5-2]"])
def test_expand_hostlist_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="hostlist"):
        expand_hostlist(bad)


def test_slurm_env_idris_style() -> None:
    env = resolve_env(
        {
            "SLURM_PROCID": "5",
            "SLURM_LOCALID": "1",
            "SLURM_NTASKS": "8",
            "SLURM_NTASKS_PER_NODE": "4",
            "SLURM_JOB_NODELIST": "jz[001-002]",
            "SLURM_JOB_ID": "123456",
        }
    )
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (5, 1, 8, 4)
    assert env.master_addr == "jz001"
    assert env.master_port == port_from_job_id("123456")
    assert 20000 <= env.master_port < 30000
    assert env.source == "slurm" and env.job_id == "123456"


def test_slurm_port_same_on_every_node_and_tasks_per_node_fallback() -> None:
    base = {
        "SLURM_NTASKS": "4",
        "SLURM_NODELIST": "n[1-2]",
        "SLURM_JOB_ID": "77",
        "SLURM_TASKS_PER_NODE": "2(x2)",
    }
    envs = [
        resolve_env({**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r % 2)}) for r in range(4)
    ]
    assert {e.master_port for e in envs} == {port_from_job_id("77")}
    assert {e.master_addr for e in envs} == {"n1"}
    assert all(e.local_world_size == 2 for e in envs)


def test_torchrun_env_wins_over_slurm() -> None:
    env = resolve_env(
        {
            "RANK": "1",
            "LOCAL_RANK": "1",
            "WORLD_SIZE": "2",
            "MASTER_ADDR": "10.0.0.1",
            "MASTER_PORT": "29555",
            "SLURM_PROCID": "0",
            "SLURM_NTASKS": "1",
        }
    )
    assert (env.rank, env.world_size, env.master_addr, env.master_port, env.source) == (
        1,
        2,
        "10.0.0.1",
        29555,
        "torchrun",
    )


def test_single_process() -> None:
    env = resolve_env({})
    assert (env.rank, env.world_size, env.source, env.is_main, env.is_distributed) == (
        0,
        1,
        "single",
        True,
        False,
    )


def test_bad_integer_names_variable() -> None:
    with pytest.raises(ValueError, match="SLURM_PROCID='x'"):
        resolve_env({"SLURM_PROCID": "x", "SLURM_NTASKS": "2"})
