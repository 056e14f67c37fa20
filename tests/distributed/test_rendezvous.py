"""A rendezvous that cannot silently split (distributed/rendezvous.py), and the interface of
each channel on an InfiniBand profile (distributed/interfaces.py).

Each split a user of another trainer met is made here with SLURM's own variables, and
`hpctrain train` ends in one line, exit 6, before any collective. Node names that must resolve
to two machines are IP literals that are no address of this one (TEST-NET, RFC 5737), or a
table (the unit tests say so): this is one machine. No InfiniBand here either: the fabric's
interface is chosen from made-up interfaces, and the multi-process case binds gloo to the
loopback interface named as the profile's.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch.distributed as dist

from hpctrain.cli.main import main
from hpctrain.distributed import DistEnv, resolve_env
from hpctrain.distributed.interfaces import (
    FabricChoice,
    FabricInterfaceError,
    Interface,
    describe_channels,
    fabric_interface,
    gloo_interface,
    local_interfaces,
)
from hpctrain.distributed.rendezvous import (
    RendezvousError,
    agree_on_view,
    check_master,
    check_world,
)
from hpctrain.errors import EXIT_LAUNCH
from hpctrain.launch.local import free_port
from tests.distributed.test_group import one_rank_per_thread
from tests.support.slurm_kit import DEMO

ELSEWHERE = "203.0.113.7"  # another machine: an address of none of this one's interfaces
STEP = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0"}
CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
           "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NTASKS_PER_NODE",
           "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURMD_NODENAME",
           "SLURM_JOB_ID", "SLURM_STEP_ID", "HPCTRAIN_LAUNCHER", "TORCHELASTIC_RUN_ID",
           "HPCTRAIN_DEBUG", "HPCTRAIN_FABRIC", "HPCTRAIN_FABRIC_MASTER")  # fmt: skip


def train_in(
    environ: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> tuple[int, list[str]]:
    """`hpctrain train` of the demo config as one task with `environ`: its code and lines."""
    for key in CLEARED:
        monkeypatch.delenv(key, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)
    code = main(["train", DEMO, f"run_dir={tmp_path / 'run'}"])
    return code, [line for line in capsys.readouterr().err.splitlines() if "hpctrain" in line]


# ------------------------------------------------------------------------------ the world
def test_a_world_of_one_in_a_step_of_four_is_one_line_exit_6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A container that passes SLURM_NTASKS but not SLURM_PROCID: every task would train alone."""
    environ = {**STEP, "SLURM_NTASKS": "4", "SLURMD_NODENAME": "n2"}
    code, lines = train_in(environ, tmp_path, monkeypatch, capsys)
    assert code == EXIT_LAUNCH
    assert lines == [
        "hpctrain train: launch error: rendezvous: SLURM_NTASKS=4 in job 77 step 0 but rank 0 "
        "on n2 sees a world of 1 (SLURM_PROCID is not set in this task's environment (a "
        "container that does not pass SLURM's variables?)); the world must be 4: every task "
        "would otherwise train apart or wait for others that never come"
    ]


def test_a_world_size_set_by_hand_in_a_step_is_refused_and_a_launcher_per_task_is_not() -> None:
    environ = {**STEP, "SLURM_NTASKS": "4", "RANK": "0", "WORLD_SIZE": "1"}
    with pytest.raises(RendezvousError, match=r"sees a world of 1 \(WORLD_SIZE=1 is set"):
        check_world(resolve_env(environ), environ)
    # torchrun under srun, one task per node running 4 ranks: 2 tasks x 4
    torchrun = {**STEP, "SLURM_NTASKS": "2", "RANK": "5", "WORLD_SIZE": "8",
                "LOCAL_WORLD_SIZE": "4", "TORCHELASTIC_RUN_ID": "x"}  # fmt: skip
    check_world(resolve_env(torchrun), torchrun)
    # the batch shell itself (no step): not a task of a step, not checked
    check_world(resolve_env({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}), {"SLURM_NTASKS": "4"})


# ------------------------------------------------------------------------------ the master
def test_a_loopback_master_on_the_second_of_two_nodes_is_one_line_exit_6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MASTER_ADDR fell back to localhost (a wrapper's default): the second node's tasks
    would wait for a rendezvous of their own while rank 0 serves one on the first node."""
    environ = {**STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
               "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": f"{ELSEWHERE},n2",
               "SLURMD_NODENAME": "n2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29999"}  # fmt: skip
    code, lines = train_in(environ, tmp_path, monkeypatch, capsys)
    assert code == EXIT_LAUNCH
    assert lines == [
        "hpctrain train [rank 1]: launch error: rendezvous: MASTER_ADDR=127.0.0.1 (127.0.0.1) "
        f"on n2 is loopback, but rank 0 runs on {ELSEWHERE} ({ELSEWHERE}) in a job of 2 nodes: "
        "the tasks of n2 would wait for a rendezvous of their own; unset MASTER_ADDR or set it "
        f"to {ELSEWHERE}"
    ]


def test_a_master_address_rank_0_does_not_own_is_one_line_exit_6(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """MASTER_ADDR exported from the batch shell names the batch host, which this step does
    not run on (a spare, a node set aside): rank 0 serves the store where nobody looks."""
    environ = {**STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": "0", "SLURM_LOCALID": "0",
               "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "n1,n2",
               "SLURMD_NODENAME": "n1", "MASTER_ADDR": ELSEWHERE, "MASTER_PORT": "29999"}  # fmt: skip
    code, lines = train_in(environ, tmp_path, monkeypatch, capsys)
    assert code == EXIT_LAUNCH
    assert lines == [
        f"hpctrain train [rank 0]: launch error: rendezvous: MASTER_ADDR={ELSEWHERE} "
        f"({ELSEWHERE}) is no address of n1, where rank 0 serves the rendezvous store: the "
        "other tasks would wait for a store nobody serves; unset MASTER_ADDR (hpctrain takes "
        "the step's first node, n1) or name rank 0's node"
    ]


def slurm_env(rank: int, node: str, **extra: str) -> tuple[DistEnv, dict[str, str]]:
    environ = {**STEP, "SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": "0",
               "SLURM_NTASKS_PER_NODE": "1", "SLURM_STEP_NODELIST": "n[1-2]",
               "SLURMD_NODENAME": node, **extra}  # fmt: skip
    return resolve_env(environ), environ


def test_every_node_must_name_the_master_rank_0_owns() -> None:
    """Two machines by a table (one machine here): n1 10.0.0.1, n2 10.0.0.2, this one n2."""
    table = {"n1": {"10.0.0.1"}, "n2": {"10.0.0.2"}, "localhost": {"127.0.0.1"},
             "10.1.0.1": {"10.1.0.1"}}  # fmt: skip
    on_n2 = {"10.0.0.2", "127.0.0.1"}

    def check(env: DistEnv, environ: dict[str, str]) -> None:
        check_master(env, environ, resolver=table.__getitem__, local=on_n2.__contains__)

    check(*slurm_env(1, "n2"))  # the master derived from the node list: n1
    # each node's MASTER_ADDR=$(hostname), by a wrapper: n2 names itself
    with pytest.raises(RendezvousError, match="MASTER_ADDR=n2 .* on n2 is an address of n2 "
                       "itself, but rank 0 runs on n1 \\(10.0.0.1\\)"):  # fmt: skip
        check(*slurm_env(1, "n2", MASTER_ADDR="n2"))
    with pytest.raises(RendezvousError, match="MASTER_ADDR=localhost .* is loopback"):
        check(*slurm_env(1, "n2", MASTER_ADDR="localhost"))
    # n1's fabric address from its probe: another name of the same node, fine on n2
    check(*slurm_env(1, "n2", HPCTRAIN_FABRIC_MASTER="n1=10.1.0.1"))
    # rank 0 on n2 (this machine) naming n1: nobody serves where the others look
    with pytest.raises(RendezvousError, match="MASTER_ADDR=n1 \\(10.0.0.1\\) is no address of n2"):
        check(*slurm_env(0, "n2", MASTER_ADDR="n1"))
    # nodes of one machine (the dev cluster: n1, n2 are 127.0.0.1): loopback is right
    one_host = {"n1": {"127.0.0.1"}, "n2": {"127.0.0.1"}}
    env, environ = slurm_env(1, "n2")
    check_master(env, environ, resolver=one_host.__getitem__, local=on_n2.__contains__)


def test_a_master_name_that_does_not_resolve_is_one_line() -> None:
    env, environ = slurm_env(1, "n2", MASTER_ADDR="no-such-host.invalid")
    with pytest.raises(
        RendezvousError, match="MASTER_ADDR=no-such-host.invalid does not resolve on n2"
    ):
        check_master(env, environ)


# ------------------------------------------------------------------------------ the store
def test_a_task_of_another_job_that_reached_the_store_fails_every_task_in_one_line() -> None:
    """Ranks as threads on a real store: rank 1 belongs to job 88 (a port shared with another
    job's rendezvous). Every task fails with the same line, naming both views."""
    store = dist.HashStore()
    store.set_timeout(datetime.timedelta(seconds=30))
    views = [slurm_env(0, "n1"), slurm_env(1, "n2", SLURM_JOB_ID="88")]
    errors = one_rank_per_thread(2, lambda rank: agree_on_view(store, *views[rank]))
    assert all(isinstance(e, RendezvousError) for e in errors), errors
    assert (
        str(errors[0])
        == str(errors[1])
        == (
            "rendezvous: rank 1 on n2 (job 88 step 0, world 2, master n1:20088) reached the "
            "rendezvous store of rank 0 on n1 (job 77 step 0, world 2, master n1:20077): a port "
            "shared with another job, or a world size set by hand; set MASTER_PORT apart, or unset "
            "WORLD_SIZE"
        )
    )
    agreed = dist.HashStore()
    agreed.set_timeout(datetime.timedelta(seconds=30))
    same = [slurm_env(0, "n1"), slurm_env(1, "n2")]
    assert one_rank_per_thread(2, lambda rank: agree_on_view(agreed, *same[rank])) == [None, None]


# ------------------------------------------------------------------------------ the fabric
IB0 = Interface("ib0", "10.1.0.2", "infiniband")
IB1 = Interface("ib1", "10.2.0.2", "infiniband")
ETH = Interface("eth0", "192.168.0.2", "ethernet")
LO = Interface("lo", "127.0.0.1", "loopback")


def test_the_fabrics_interface_is_chosen_from_the_profile_then_nccls_choice() -> None:
    """Made-up interfaces and HCAs: this machine has no InfiniBand."""
    interfaces = [LO, ETH, IB0, IB1]
    hcas = {"mlx5_0": ["ib0"], "mlx5_1": ["ib1"], "": ["mlx5_0", "mlx5_1"]}.__getitem__

    def choose(**environ: str) -> tuple[str, str] | None:
        choice = fabric_interface(environ, interfaces, hcas, node="n2")
        return (choice.interface.name, choice.source) if choice else None

    assert choose() == ("ib0", "the first InfiniBand interface")
    assert choose(HPCTRAIN_FABRIC_INTERFACE="ib1") == ("ib1", "the profile's fabric_interface")
    assert choose(NCCL_SOCKET_IFNAME="ib1") == ("ib1", "NCCL_SOCKET_IFNAME=ib1")
    assert choose(NCCL_SOCKET_IFNAME="^ib,lo")[0] == "eth0"  # NCCL's exclusion syntax
    assert choose(NCCL_SOCKET_IFNAME="=ib")[0] == "ib0"  # exact: no "ib", then IB's own
    assert choose(NCCL_IB_HCA="mlx5_1:1") == ("ib1", "NCCL_IB_HCA=mlx5_1:1 (mlx5_1)")
    assert choose(NCCL_IB_HCA="^mlx5_0")[0] == "ib1"
    assert fabric_interface({}, [LO, ETH]) is None  # no IPoIB: the default route
    with pytest.raises(FabricInterfaceError, match="fabric_interface=ib2: no such interface "
                       "with an IPv4 address on n2 \\(interfaces: lo 127.0.0.1, eth0"):  # fmt: skip
        choose(HPCTRAIN_FABRIC_INTERFACE="ib2")
    choice = FabricChoice(IB0, "the first InfiniBand interface")
    assert gloo_interface({}, choice) == {"GLOO_SOCKET_IFNAME": "ib0"}
    assert gloo_interface({"GLOO_SOCKET_IFNAME": "eth0"}, choice) == {}  # yours stands


def test_start_up_names_each_channels_interface_and_warns_off_the_fabric() -> None:
    """This machine's own interfaces: the store on loopback, the "fabric" a real interface
    of the machine named as the profile's (no InfiniBand here)."""
    interfaces = local_interfaces()
    other = next((i for i in interfaces if i.kind != "loopback"), None)
    assert other is not None, f"this test needs an interface besides loopback: {interfaces}"
    choice = FabricChoice(other, "the profile's fabric_interface")
    environ = {"GLOO_SOCKET_IFNAME": other.name}
    line, warning = describe_channels(
        "127.0.0.1:20077", "MASTER_ADDR", environ, interfaces, choice, fabric="infiniband"
    )
    assert line.startswith(
        f"channels: rendezvous store 127.0.0.1:20077 (MASTER_ADDR) via lo 127.0.0.1; gloo via "
        f"{other.name} (GLOO_SOCKET_IFNAME, the fabric's interface: the profile's "
        "fabric_interface); NCCL bootstrap via its own choice"
    )
    assert warning.startswith(
        f"the rendezvous store 127.0.0.1:20077 is reached through lo (127.0.0.1), not the "
        f"fabric's {other.name}"
    )
    on_fabric = describe_channels(
        f"{other.address}:20077", "x", environ, interfaces, choice, fabric="infiniband"
    )
    assert f"via {other.name} {other.address}" in on_fabric[0] and on_fabric[1] == ""


@pytest.mark.distributed
@pytest.mark.slow  # two processes import torch
def test_gloo_binds_to_the_fabrics_interface_and_start_up_says_so(tmp_path: Path) -> None:
    """Two ranks as two pretended nodes of an InfiniBand profile whose `fabric_interface` is
    the loopback interface (no InfiniBand here): gloo is bound to it, the all-reduce works,
    and rank 0's log names the interface of each channel."""
    port = free_port()
    script = textwrap.dedent("""
        import json, logging, os, sys, torch, torch.distributed as dist
        from hpctrain.distributed import DistEnv
        from hpctrain.distributed.group import init_process_group
        logging.basicConfig(level=logging.INFO, format="%(message)s")
        rank = int(sys.argv[1])
        env = DistEnv(rank, 0, 2, 1, "127.0.0.1", int(sys.argv[2]), "torchrun")
        init_process_group(env, torch.device("cpu"), 60)
        t = torch.ones(1)
        dist.all_reduce(t)
        print(json.dumps({"sum": t.item(), "gloo": os.environ["GLOO_SOCKET_IFNAME"]}))
        dist.destroy_process_group()
    """)
    environ = {**os.environ, "HPCTRAIN_FABRIC": "infiniband", "HPCTRAIN_FABRIC_INTERFACE": "lo"}
    environ.pop("GLOO_SOCKET_IFNAME", None)
    procs = [
        subprocess.Popen([sys.executable, "-c", script, str(r), str(port)], env=environ,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for r in range(2)
    ]  # fmt: skip
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [json.loads(out) for out, _err in outs] == [{"sum": 2.0, "gloo": "lo"}] * 2
    assert (
        f"channels: rendezvous store 127.0.0.1:{port} (MASTER_ADDR) via lo 127.0.0.1; gloo via "
        "lo (GLOO_SOCKET_IFNAME, the fabric's interface: the profile's fabric_interface)"
    ) in outs[0][1]
