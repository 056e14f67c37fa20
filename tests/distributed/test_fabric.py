"""Which network NCCL uses, against the cluster profile's fabric (distributed/fabric.py).

No GPU or InfiniBand here: NCCL's init log is written as NCCL writes it (its INIT/NET lines,
"Using network IB" or "Using network Socket"); tools/gpu_bench.sh reads a real one.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hpctrain.distributed.fabric import (
    FabricError,
    check_fabric,
    fabric_problem,
    nccl_log_env,
    network_in_log,
)

IB_LOG = """\
gpu12:2201:2201 [0] NCCL INFO Bootstrap : Using ib0:10.0.0.12<0>
gpu12:2201:2201 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.0.0.12<0>
gpu12:2201:2201 [0] NCCL INFO Using network IB
gpu12:2201:2237 [0] NCCL INFO comm 0x55d0 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0
"""
SOCKET_LOG = """\
gpu12:2201:2201 [0] NCCL INFO NET/IB : No device found.
gpu12:2201:2201 [0] NCCL INFO NET/Socket : Using [0]eth0:10.1.0.12<0>
gpu12:2201:2201 [0] NCCL INFO Using network Socket
"""


def test_the_network_is_read_from_ncclss_init_log() -> None:
    assert network_in_log(IB_LOG) == "IB"
    assert network_in_log(SOCKET_LOG) == "Socket"
    assert network_in_log("gpu1:1:1 [0] NCCL INFO Using network AWS Libfabric\n") == "AWS"
    assert network_in_log("") is None


def test_sockets_on_an_infiniband_cluster_is_one_line_naming_what_to_set() -> None:
    line = fabric_problem("infiniband", "Socket")
    assert line is not None and "\n" not in line
    assert "NCCL_IB_HCA" in line and "NCCL_IB_DISABLE" in line
    assert fabric_problem("infiniband", "IB") is None
    assert fabric_problem("", "Socket") is None  # the profile names no fabric
    assert fabric_problem("ethernet", "Socket") is None


def test_the_log_goes_to_a_file_unless_the_user_set_ncclss_logging(tmp_path: Path) -> None:
    env = nccl_log_env({}, tmp_path)
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert env["NCCL_DEBUG_FILE"] == str(tmp_path / "nccl-init-%h-%p.log")
    assert nccl_log_env({"NCCL_DEBUG": "WARN"}, tmp_path) == {}
    assert nccl_log_env({"NCCL_DEBUG_FILE": "/x"}, tmp_path) == {}


def test_check_fabric_warns_or_refuses_and_removes_the_log(tmp_path: Path) -> None:
    (tmp_path / "nccl-init-gpu12-2201.log").write_text(SOCKET_LOG)
    assert "TCP sockets" in str(check_fabric(tmp_path, "infiniband", required=False))
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "nccl-init-gpu12-2201.log").write_text(SOCKET_LOG)
    with pytest.raises(FabricError, match="slurm.require_fabric=true: NCCL uses TCP sockets"):
        check_fabric(tmp_path, "infiniband", required=True)
    (tmp_path / "nccl-init-gpu12-2201.log").write_text(IB_LOG)
    assert check_fabric(tmp_path, "infiniband", required=True) is None
    assert FabricError("x").exit_code == 6  # a launch error: never retried
