"""The SLURM tier: real jobs on the local dev cluster (tools/dev-cluster), CPU and gloo.

Every wait is bounded; every job a test starts is cancelled when the test ends.
"""

from __future__ import annotations

import itertools
import subprocess
import sys
from pathlib import Path

import pytest
import submitit

from hpctrain.launch.status import run_status
from tests.support.slurm_kit import (
    DEMO,
    REPO,
    hpctrain,
    log_text,
    read_metrics,
    sacct_nodes,
    scancel,
    submit,
    train_overrides,
    wait_finished,
    wait_for,
    wait_step,
)

pytestmark = [pytest.mark.slurm, pytest.mark.usefixtures("slurm_cluster")]
HERE = Path(__file__).parent
WORKER = HERE.parent / "support" / "allreduce_worker.py"  # a 2-rank all-reduce as a SLURM task

# Tests that signal a run once it reached step 20 need the rest of the run to outlast the
# signal's way there on any machine: a floor of 30 ms a step (see tests/support/slow_tasks.py).
SLOW_STEPS = ("task=tests.support.slow_tasks:SlowImageClassification", "task_options.step_s=0.03")


def test_plumbing_sbatch_two_tasks_allreduce(tmp_path: Path, jobs: list[str]) -> None:
    out = tmp_path / "out.txt"
    job_id = subprocess.run(
        ["sbatch", "--parsable", "--ntasks=2", "--time=2", f"--output={out}",
         f"--wrap=srun {sys.executable} {WORKER}"],
        capture_output=True, text=True, check=True, timeout=30,
    ).stdout.strip()  # fmt: skip
    jobs.append(job_id)
    wait_for(
        "the all-reduce job's output",
        lambda: out.exists() and out.read_text().count("sum=3") == 2,
        90,
    )
    assert "rank=0 world=2" in out.read_text() and "rank=1 world=2" in out.read_text()


def test_plumbing_submitit_two_nodes(tmp_path: Path, jobs: list[str]) -> None:
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(nodes=2, tasks_per_node=1, timeout_min=5, cpus_per_task=1)
    job = executor.submit(submitit.helpers.CommandFunction([sys.executable, str(WORKER)]))
    jobs.append(job.job_id)
    outputs = wait_for("both submitit tasks", lambda: job.done() and job.results(), 90)
    text = "".join(str(o) for o in outputs)
    assert text.count("sum=3") == 2
    assert "node=n1" in text and "node=n2" in text


def test_submit_one_node_two_tasks_completes(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    jobs += submit(
        *train_overrides(tiny_shards, run_dir, "train.max_steps=6", "checkpoint.every_steps=3")
    )
    status = wait_finished(run_dir, 120)
    assert status.state == "COMPLETED", status
    assert [m["step"] for m in read_metrics(run_dir)] == list(range(1, 7))
    assert (run_dir / "checkpoints" / "step-6").is_dir()
    out = hpctrain("status", str(run_dir)).stdout
    assert "state:     COMPLETED" in out and "last step: 6" in out
    assert "rank 0/2" in log_text(run_dir)
    assert (run_dir / "slurm").stat().st_mode & 0o077 == 0  # private job folder


def test_submit_two_nodes_one_task_each(tiny_shards: Path, tmp_path: Path, jobs: list[str]) -> None:
    run_dir = tmp_path / "run"
    jobs += submit(
        *train_overrides(
            tiny_shards, run_dir, "train.max_steps=4", "slurm.nodes=2", "slurm.gpus_per_node=1"
        )
    )
    status = wait_finished(run_dir, 120)
    assert status.state == "COMPLETED", status
    # the accounting record may name only the first node for a moment
    wait_for("sacct to list both nodes", lambda: sacct_nodes(status.job_id) == "n[1-2]", 30)
    assert [m["step"] for m in read_metrics(run_dir)][-1] == 4


def test_hsdp_over_two_nodes_shards_inside_each(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """train.strategy=hsdp with shard_degree 0 takes the 2 tasks of a node from SLURM."""
    run_dir = tmp_path / "run"
    jobs += submit(
        *train_overrides(
            tiny_shards,
            run_dir,
            "train.max_steps=3",
            "train.strategy=hsdp",
            "slurm.nodes=2",
            "slurm.gpus_per_node=2",
        )
    )
    status = wait_finished(run_dir, 180)
    assert status.state == "COMPLETED", status
    records = read_metrics(run_dir)
    assert records[0]["mesh"] == "replicate 2 x shard 2" and records[-1]["step"] == 3
    assert "mesh: replicate 2 x shard 2 (train.strategy=hsdp)" in log_text(run_dir)


def test_preemption_requeues_and_resumes_to_the_same_weights(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """USR2 from scancel, then submitit's own interrupt: two requeues, one uninterrupted result.

    In-process loading (workers_per_rank=0) for a bitwise comparison without worker timing;
    the test below covers SIGTERM reaching loader workers.
    """
    steps = "train.max_steps=300"
    preempted, straight = tmp_path / "preempted", tmp_path / "straight"
    same = ("train.deterministic=true", "data.workers_per_rank=0", *SLOW_STEPS)
    jobs += submit(*train_overrides(tiny_shards, straight, steps, *same))  # runs meanwhile
    jobs += submit(*train_overrides(tiny_shards, preempted, steps, *same))
    job_id = jobs[-1]

    first = wait_step(preempted, 20, 120)
    scancel("--signal=USR2", job_id)
    wait_for("a requeue", lambda: run_status(str(preempted)).requeues >= 1, 60)
    assert "preemption requested" in log_text(preempted)

    wait_step(preempted, first + 30, 120)  # training again, past the first save
    submitit.SlurmJob(folder=preempted / "slurm" / "submitit", job_id=job_id)._interrupt()
    status = wait_finished(preempted, 240)
    assert status.state == "COMPLETED", status
    assert status.requeues == 2, status
    log = log_text(preempted)
    assert log.count("resumed from step") >= 2, log[-3000:]
    steps_seen = [m["step"] for m in read_metrics(preempted)]
    assert steps_seen[-1] == 300 and sorted(set(steps_seen)) == list(range(1, 301))

    assert wait_finished(straight, 120).state == "COMPLETED"
    assert_same_weights(
        preempted / "checkpoints" / "step-300", straight / "checkpoints" / "step-300", tmp_path
    )


def test_sigterm_to_all_step_processes_with_loader_workers(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """SLURM signals every process of the step (as on preemption): loader workers survive."""
    run_dir = tmp_path / "run"
    jobs += submit(
        *train_overrides(
            tiny_shards, run_dir, "train.max_steps=300", "data.workers_per_rank=1", *SLOW_STEPS
        )
    )
    wait_step(run_dir, 20, 120)
    scancel("--signal=TERM", jobs[-1])
    status = wait_finished(run_dir, 150)
    assert status.state == "COMPLETED" and status.requeues == 1, status


def assert_same_weights(a: Path, b: Path, tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(a, tmp_path / "a.pt")
    dcp_to_torch_save(b, tmp_path / "b.pt")
    sa = torch.load(tmp_path / "a.pt", weights_only=True)
    sb = torch.load(tmp_path / "b.pt", weights_only=True)

    def tensors(tree: object, prefix: str = "") -> dict[str, torch.Tensor]:
        if isinstance(tree, torch.Tensor):
            return {prefix: tree}
        if isinstance(tree, dict):
            return {
                k: v
                for key, sub in tree.items()
                for k, v in tensors(sub, f"{prefix}/{key}").items()
            }
        return {}

    ta, tb = tensors(sa), tensors(sb)
    model_keys = [k for k in ta if "model" in k and "rank" not in k]
    assert model_keys and set(model_keys) <= set(tb)
    for key in model_keys:
        assert torch.equal(ta[key], tb[key]), (
            f"{key} differs between the preempted and the straight run"
        )


def test_time_limit_completes_over_several_requeues(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    """A 1-minute job; the trainer stops 40 s before SLURM_JOB_END_TIME (exported by the job
    script on SLURM < 23.02; SLURM's own USR2 may come up to ~30 s early since the controller
    checks limits every ~30 s) and requeues itself, until the training is done.

    At most ~20 s of each allocation trains; 300 steps of at least 0.15 s (45 s) need three
    allocations or more however fast the machine is."""
    run_dir = tmp_path / "run"
    jobs += submit(
        *train_overrides(
            tiny_shards, run_dir, "train.max_steps=300", "data.batch_size=32",
            "task=tests.support.slow_tasks:SlowImageClassification", "task_options.step_s=0.15",
            "slurm.time=1", "slurm.signal_margin_s=5", "slurm.max_requeues=12",
            "checkpoint.deadline_margin_s=40",
        )
    )  # fmt: skip
    status = wait_finished(run_dir, 540)
    assert status.state == "COMPLETED", status
    assert status.requeues >= 2, status
    assert [m["step"] for m in read_metrics(run_dir)][-1] == 300


def test_plain_sbatch_script_trains_and_requeues(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    script = tmp_path / "job.sbatch"
    hpctrain(
        "sbatch",
        DEMO,
        *train_overrides(tiny_shards, run_dir, "train.max_steps=150", *SLOW_STEPS),
        "-o",
        str(script),
    )
    job_id = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
        cwd=REPO,  # the job's working directory: tests.support.slow_tasks importable
    ).stdout.strip()
    jobs.append(job_id)
    wait_step(run_dir, 20, 120)
    scancel("--signal=USR2", job_id)
    status = wait_finished(run_dir, 180)
    assert status.state == "COMPLETED", status
    log = (run_dir / "slurm" / f"{job_id}.out").read_text()
    assert "requeueing job" in log and "(restart 1)" in log and "resumed from step" in log
    assert status.requeues == 1 and [m["step"] for m in read_metrics(run_dir)][-1] == 150


def test_sweep_gives_an_array_and_a_run_folder_per_value(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "sweep"
    ids = submit(
        *train_overrides(tiny_shards, run_dir, "train.max_steps=3"),
        "--sweep",
        "train.lr=0.001,0.002",
    )
    jobs += ids
    assert len(ids) == 2 and {i.split("_")[1] for i in ids} == {"0", "1"}
    assert len({i.split("_")[0] for i in ids}) == 1  # one array job
    for lr in ("0.001", "0.002"):
        folder = run_dir / f"lr-{lr}"
        assert wait_finished(folder, 180).state == "COMPLETED"
        assert f"lr: {lr}" in (folder / "config.yaml").read_text()


def test_cancelled_job_is_reported_failed(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "run"
    jobs += submit(*train_overrides(tiny_shards, run_dir, "train.max_steps=100000"))
    wait_step(run_dir, 3, 120)
    scancel(jobs[-1])
    status = wait_finished(run_dir, 60)
    assert status.state == "CANCELLED" and status.failed
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", "status", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 1 and "(failed)" in proc.stdout


def array_task_intervals(array_id: str) -> list[tuple[str, str, str]]:
    """(JobID, Start, End) of every task of an array job, from sacct."""
    out = subprocess.run(
        ["sacct", "-X", "-n", "-P", "-j", array_id, "-o", "JobID,Start,End"],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    return [tuple(line.split("|")) for line in out.splitlines() if line.strip()]  # type: ignore[misc]


def assert_one_at_a_time(array_id: str, num_tasks: int) -> None:
    # both tasks fit on the cluster at once (2 nodes x 2 CPUs, 2 tasks x 1 CPU each): only
    # the %1 throttle keeps them apart
    rows = wait_for(
        f"sacct to record the {num_tasks} finished tasks of array {array_id}",
        lambda: (
            (r := array_task_intervals(array_id))
            and len(r) == num_tasks
            and all(end not in ("", "Unknown") for _, _, end in r)
            and r
        ),
        60,
    )
    spans = sorted((start, end) for _, start, end in rows)
    for (_, end), (start, _) in itertools.pairwise(spans):
        assert start >= end, f"array {array_id}: tasks overlapped: {rows}"


def test_submit_sweep_max_parallel_one_runs_one_task_at_a_time(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "sweep"
    ids = submit(
        *train_overrides(tiny_shards, run_dir, "train.max_steps=3"),
        "--sweep",
        "train.lr=0.001,0.002",
        "--max-parallel",
        "1",
    )
    jobs += ids
    array_id = ids[0].split("_")[0]
    for lr in ("0.001", "0.002"):
        assert wait_finished(run_dir / f"lr-{lr}", 240).state == "COMPLETED"
    out = subprocess.run(
        ["scontrol", "show", "job", array_id], capture_output=True, text=True, timeout=30
    ).stdout
    assert "ArrayTaskThrottle=1" in out or out == "", out  # gone from scontrol once purged
    assert_one_at_a_time(array_id, 2)


def test_sbatch_sweep_max_parallel_one_runs_one_task_at_a_time(
    tiny_shards: Path, tmp_path: Path, jobs: list[str]
) -> None:
    run_dir = tmp_path / "sweep"
    script = tmp_path / "sweep.sbatch"
    hpctrain("sbatch", DEMO, *train_overrides(tiny_shards, run_dir, "train.max_steps=3"),
             "--sweep", "train.lr=0.001,0.002", "--max-parallel", "1", "-o", str(script))  # fmt: skip
    assert "#SBATCH --array=0-1%1" in script.read_text()
    array_id = subprocess.run(
        ["sbatch", "--parsable", str(script)],
        capture_output=True, text=True, check=True, timeout=30, cwd=REPO,
    ).stdout.strip()  # fmt: skip
    jobs.append(array_id)
    for lr in ("0.001", "0.002"):
        folder = run_dir / f"lr-{lr}"
        assert wait_finished(folder, 240).state == "COMPLETED"
        assert f"lr: {lr}" in (folder / "config.yaml").read_text()
        out = hpctrain("status", str(folder)).stdout
        assert "COMPLETED" in out and "jobs:" in out
    assert_one_at_a_time(array_id, 2)


def test_preflight_catches_a_missing_qos_and_a_live_limit(tmp_path: Path) -> None:
    """The local-dev profile lists no QoS: only the live cluster (sacctmgr) can say."""
    args = ["preflight", DEMO, "--no-data", f"run_dir={tmp_path / 'run'}", "--profile", "local-dev"]
    proc = subprocess.run(
        [sys.executable, "-m", "hpctrain", *args, "slurm.qos=qos_gpu-t3"],
        capture_output=True, text=True, timeout=300, cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 6, proc.stdout + proc.stderr
    assert "FAIL qos: slurm.qos='qos_gpu-t3': the cluster has no such QoS" in proc.stdout
    assert "normal" in proc.stdout  # what the cluster has
    ok = hpctrain(*args, "slurm.qos=normal", timeout=300).stdout
    assert "ok   qos: normal exists on the cluster" in ok and "ok   environment" in ok

    qos = "hpctrain_test_short"
    subprocess.run(["sacctmgr", "-i", "add", "qos", qos, "MaxWall=00:05:00"],
                   capture_output=True, check=True, timeout=60)  # fmt: skip
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "hpctrain", *args, f"slurm.qos={qos}", "slurm.time=00:10:00"],
            capture_output=True, text=True, timeout=300, cwd=REPO,
        )  # fmt: skip
        assert proc.returncode == 6
        assert f"above the live MaxWall 00:05:00 of QoS {qos}" in proc.stdout, proc.stdout
    finally:
        subprocess.run(["sacctmgr", "-i", "delete", "qos", qos], capture_output=True, timeout=60)
