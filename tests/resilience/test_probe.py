"""The health probe's collective (resilience/probe.py) with many peers, a silent one, and a
dead hub: who gets blamed, from the nodes' own records through `attempts place`.

The many-peers case is `hpctrain bench probe` (2,047 peers) at a small size.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path

import pytest

from hpctrain.bench.probe import gather_once
from hpctrain.config import load_config
from hpctrain.resilience.attempts import JobFacts, begin, place_attempt
from hpctrain.resilience.probe import ADDRESS_FILE, join_collective, run_probe, serve_collective


@pytest.mark.slow  # a hub process and two of peers (a second)
def test_the_hub_gathers_many_peers_at_once_past_a_low_limit_of_open_files() -> None:
    """300 peers connecting together to a hub whose soft limit is 128 descriptors (the serial
    hub failed its accepts with EMFILE: at 2,048 nodes, on a cluster's usual 1,024)."""
    result = gather_once("concurrent", peers=300, processes=2, timeout_s=60, open_files=128)
    assert (result["error"], result["reached"]) == ("", 300)
    assert (result["peers_ok"], result["peers_failed"]) == (300, 0)


@pytest.mark.slow  # the hub waits its timeout (1 s) for the silent peer
def test_a_peer_that_connects_and_says_nothing_holds_up_no_other(tmp_path: Path) -> None:
    """The serial hub read one peer's name before accepting the next: a peer connected and
    silent held every other for the whole timeout, then failed the hub (a TimeoutError)."""
    answered: list[float] = []

    def silent() -> None:
        while not (tmp_path / ADDRESS_FILE).exists():
            time.sleep(0.01)
        _node, host, port = (tmp_path / ADDRESS_FILE).read_text().split()
        with socket.create_connection((host, int(port))):
            time.sleep(3)  # connected, never says who it is

    def peer(i: int) -> None:
        time.sleep(0.3)  # after the silent one
        answered.append(join_collective(tmp_path, f"p{i}", 10))

    threads = [threading.Thread(target=silent)]
    threads += [threading.Thread(target=peer, args=(i,)) for i in range(20)]
    for thread in threads:
        thread.start()
    gathered = serve_collective(tmp_path, "localhost", 21, 1.0)
    for thread in threads:
        thread.join(30)
    assert sorted(gathered.reached) == sorted(f"p{i}" for i in range(20))
    assert len(answered) == 20


@pytest.mark.slow  # three probes, the hub waits its timeout (2 s)
def test_a_dead_hub_is_blamed_alone_and_the_others_train(tmp_path: Path) -> None:
    """The hub's name resolves on no other node (no DNS entry: its listener is unreachable):
    every peer fails "cannot reach n0" and the hub sees nobody. Only the hub is set aside;
    the nodes that could not reach it passed every check of their own and train (before:
    all three were set aside, and a requeue would have excluded them all)."""
    with pytest.raises(OSError):
        socket.getaddrinfo("n0", None)  # the dead hub: no such host here
    data = tmp_path / "data"
    data.mkdir()
    (data / "index.json").write_text("{}")
    cfg = load_config(
        None,
        [
            f"run_dir={tmp_path / 'run'}",
            f"data.train={data / 'index.json'}",
            "slurm.nodes=2",
            "slurm.spare_nodes=1",
        ],
    )
    job = JobFacts(job_id="42", restart=0, allocation=("n0", "n2", "n3"), tasks_per_node=1,
                   end_time=None)  # fmt: skip
    begin(cfg, job)
    folder = tmp_path / "run" / "slurm" / "attempts" / "1"
    records: dict[str, dict[str, object]] = {}

    def probe(rank: int, node: str) -> None:
        records[node] = run_probe(
            folder, cfg, gpus=0, rank=rank, num_nodes=3, node=node, timeout_s=2.0, hub="n0"
        )

    threads = [threading.Thread(target=probe, args=(r, n)) for r, n in enumerate(job.allocation)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert records["n0"]["failed_check"] == "collective" and records["n0"]["peers_reached"] == 0
    assert [records[n]["blames"] for n in ("n2", "n3")] == ["n0", "n0"]
    out = place_attempt(cfg, job)
    assert "TRAIN_NODES=n2,n3" in out.splitlines()
    placed = json.loads((folder / "place.json").read_text())
    assert list(placed["set_aside"]) == ["n0"]
    assert (
        "the hub, reached by 0 node(s); 2 could not reach it (n2, n3)" in placed["set_aside"]["n0"]
    )


@pytest.mark.slow  # two probes in threads (a fraction of a second)
def test_on_an_infiniband_profile_the_probe_runs_on_the_fabric_and_hands_its_address_on(
    tmp_path: Path,
) -> None:
    """The profile's `fabric_interface` is the loopback interface here (no InfiniBand): the
    hub listens on it alone, each record holds the node's fabric address, and `place` hands
    the first training node's to the ranks (their store's MASTER_ADDR)."""
    from hpctrain.distributed import resolve_env

    data = tmp_path / "data"
    data.mkdir()
    (data / "index.json").write_text("{}")
    cfg = load_config(None, [f"run_dir={tmp_path / 'run'}", f"data.train={data / 'index.json'}"])
    job = JobFacts(job_id="42", restart=0, allocation=("n1", "n2"), tasks_per_node=1,
                   end_time=None)  # fmt: skip
    begin(cfg, job)
    folder = tmp_path / "run" / "slurm" / "attempts" / "1"
    environ = {"HPCTRAIN_FABRIC": "infiniband", "HPCTRAIN_FABRIC_INTERFACE": "lo"}
    records: dict[str, dict[str, object]] = {}

    def probe(rank: int, node: str) -> None:
        records[node] = run_probe(
            folder, cfg, gpus=0, rank=rank, num_nodes=2, node=node, timeout_s=30, environ=environ
        )

    threads = [threading.Thread(target=probe, args=(r, n)) for r, n in enumerate(job.allocation)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert (folder / ADDRESS_FILE).read_text().split()[:2] == ["n1", "127.0.0.1"]
    assert [records[n]["failed_check"] for n in ("n1", "n2")] == ["", ""]
    assert records["n2"]["fabric_address"] == "127.0.0.1"
    out = place_attempt(cfg, job)
    assert "export HPCTRAIN_FABRIC_MASTER=n1=127.0.0.1" in out.splitlines()
    step = {"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_NODELIST": "n[1-2]",
            "HPCTRAIN_FABRIC_MASTER": "n1=127.0.0.1"}  # fmt: skip
    env = resolve_env(step)
    assert (env.master_addr, env.master_from) == (
        "127.0.0.1",
        "n1's fabric address, from its health probe",
    )
    # the address of another step's first node is never taken
    assert resolve_env({**step, "SLURM_STEP_NODELIST": "n[2-3]"}).master_addr == "n2"
    # a node without the profile's interface fails the probe's fabric check
    missing = run_probe(
        tmp_path, cfg, gpus=0, rank=0, num_nodes=1, node="n3",
        environ={**environ, "HPCTRAIN_FABRIC_INTERFACE": "ib9"},
    )  # fmt: skip
    assert missing["failed_check"] == "fabric"
    assert str(missing["message"]).startswith(
        "the cluster profile's fabric_interface=ib9: no such interface with an IPv4 address on n3"
    )
