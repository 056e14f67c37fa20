"""`start_process`: what every training, eval and predict process does first."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hpctrain.distributed import start_process, startup
from hpctrain.distributed.startup import CUBLAS_WORKSPACE

RANK_1_OF_4 = {"RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}


@pytest.fixture
def restored_threads():
    threads = torch.get_num_threads()
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    yield
    torch.set_num_threads(threads)
    root.handlers[:], root.level = handlers, level


def test_a_cpu_rank_shares_the_cores_and_logs_with_its_rank(
    monkeypatch, restored_threads, capsys
) -> None:
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in RANK_1_OF_4.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    env, device = start_process()
    assert (env.rank, env.world_size, device.type) == (1, 4, "cpu")
    assert torch.get_num_threads() == 2  # 8 cores / 4 local ranks
    logging.getLogger("hpctrain").warning("hello")
    assert "[rank 1] WARNING hello" in capsys.readouterr().err
    assert logging.getLogger().level == logging.WARNING  # only rank 0 says more


def test_omp_num_threads_is_left_to_the_user(monkeypatch, restored_threads) -> None:
    for name, value in RANK_1_OF_4.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    torch.set_num_threads(3)
    start_process()
    assert torch.get_num_threads() == 3


def test_cublas_workspace_is_fixed_before_cuda_starts(monkeypatch, restored_threads) -> None:
    """`train.deterministic`: cuBLAS reads its workspace setting when CUDA starts, which
    `choose_device` may do; the variable is set before (a user's own is kept)."""
    for name in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS", CUBLAS_WORKSPACE):
        monkeypatch.delenv(name, raising=False)
    seen = []
    monkeypatch.setattr(
        startup,
        "choose_device",
        lambda env: seen.append(os.environ.get(CUBLAS_WORKSPACE)) or torch.device("cpu"),
    )
    start_process()
    start_process(deterministic=True)
    assert seen == [None, ":4096:8"]
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":16:8")
    start_process(deterministic=True)
    assert seen[-1] == ":16:8"


def test_the_usable_cpus_are_logged_and_too_few_for_the_workers_warned(caplog) -> None:
    """srun from SLURM 22.05 to 23.11 may give a rank one CPU whatever --cpus-per-task says
    (issue #38): the rank says how many it may use, and warns when its workers must share."""
    from hpctrain.distributed import DistEnv
    from hpctrain.distributed.startup import log_usable_cpus

    env = DistEnv(rank=3, local_rank=1, world_size=4, local_world_size=2,
                  master_addr="n1", master_port=20001, source="slurm", job_id="7")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        assert log_usable_cpus(env, 4, affinity=lambda: {0, 1, 2, 3, 4, 5}) == 6
        assert (
            "CPUs: 6 usable by each rank (sched_getaffinity), data.workers_per_rank=4"
            in caplog.text
        )
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
        caplog.clear()
        log_usable_cpus(env, 4, affinity=lambda: {7})
    (warning,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert warning.getMessage().startswith(
        "rank 3 may use 1 CPU(s) (sched_getaffinity) for itself and data.workers_per_rank=4"
    )
    assert "--cpus-per-task=5" in warning.getMessage()
    caplog.clear()
    outside = DistEnv(rank=0, local_rank=0, world_size=1, local_world_size=1,
                      master_addr="127.0.0.1", master_port=29500, source="single")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="hpctrain"):
        log_usable_cpus(outside, 4, affinity=lambda: {0})  # not a SLURM job: the user's choice
    assert caplog.records == []
