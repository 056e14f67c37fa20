"""`hpctrain convert --slurm --parts N`: the job scripts (pure rendering), and on the dev
cluster (SLURM tier) a conversion as job arrays whose failed part is run again alone."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest

from hpctrain.cli.main import main
from hpctrain.convert.options import ConvertOptions
from hpctrain.launch.convert_array import array_job, array_option, render_merge, render_stage
from hpctrain.launch.profiles import LaunchError
from hpctrain.launch.sbatch import environment_lines
from tests.convert.conftest import make_image_folder
from tests.support.slurm_kit import hpctrain, wait_for


def test_the_array_lists_the_parts_with_ranges_and_the_throttle():
    assert array_option(range(8), 0) == "0-7"
    assert array_option([0, 1, 2, 5, 7, 8], 3) == "0-2,5,7-8%3"
    assert array_option([4], 2) == "4%2"


def options(**kw) -> ConvertOptions:
    return ConvertOptions(src="/data/corpus", dest="/scratch/tokens", workers=6, **kw)


def test_a_stage_script_runs_one_part_per_array_task_with_the_profile_s_job():
    aj = array_job(
        options(),
        profile="jean-zay-h100",
        account="abc@h100",
        time="01:00:00",
        log_dir="/scratch/logs",
        max_parallel=8,
        python="/work/venv/bin/python",
    )
    script = render_stage(aj, options(tokenizer="bytes"), 64, "tokenize", [0, 1, 2, 3, 9])
    lines = script.splitlines()
    assert lines[0] == "#!/bin/bash"
    for line in (
        "#SBATCH --account=abc@h100",
        "#SBATCH --constraint=h100",
        "#SBATCH --cpus-per-task=6",  # --workers of each part
        "#SBATCH --time=01:00:00",
        "#SBATCH --output=/scratch/logs/%x-%A_%a.out",
        "#SBATCH --array=0-3,9%8",
        "module load arch/h100",  # the profile's setup lines
        "set -euo pipefail",
        # offline and the profile's caches, as every training job of the profile (#43)
        *environment_lines(aj.job, tasks=False),
    ):
        assert line in lines, line
    assert 'HF_HOME="${HF_HOME:-$SCRATCH/hpctrain/cache/huggingface}"' in script
    assert lines.index("module load arch/h100") > lines.index(environment_lines(aj.job)[1])
    assert not [x for x in lines if x.startswith(("#SBATCH --gres", "#SBATCH --gpus"))]  # no GPU
    assert lines[-1] == (
        'exec "/work/venv/bin/python" -m hpctrain convert /data/corpus /scratch/tokens '
        "--tokenizer bytes --workers 6 --progress none --parts 64 "
        '--run-part "$SLURM_ARRAY_TASK_ID" --stage tokenize'
    )
    merge = render_merge(aj, options(tokenizer="bytes"), 64).splitlines()
    assert "#SBATCH --kill-on-invalid-dep=yes" in merge and "#SBATCH --cpus-per-task=1" in merge
    assert merge[-1].endswith("--parts 64 --merge")


def test_a_credential_or_a_bad_profile_value_never_reaches_a_script():
    aj = array_job(options(), profile="local-dev", log_dir="/tmp/logs")
    leaky = ConvertOptions(src="https://user:secret@host/list.csv", dest="/scratch/out")
    with pytest.raises(LaunchError, match="user:password@") as err:
        render_stage(aj, leaky, 2, "write", [0, 1])
    assert "secret" not in str(err.value)
    with pytest.raises(LaunchError, match="accounts look like <project>@h100"):
        array_job(options(), profile="jean-zay-h100", account="abc")


def test_dry_run_prints_every_stage_and_the_merge_and_writes_nothing(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("hello")
    dest = tmp_path / "out"
    args = [str(corpus), str(dest), "--tokenizer", "bytes", "--slurm", "--parts", "4"]
    assert main(["convert", *args, "--profile", "local-dev", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if line.startswith("# ----")] == [
        "# ---- stage tokenize ----",
        "# ---- stage write ----",
        "# ---- merge ----",
    ]
    assert out.count("#SBATCH --array=0-3") == 2 and not dest.exists()
    # every job after the first is cancelled when the one before fails, not left pending
    tokenize, write, merge = out.split("# ---- ")[1:]
    assert "--kill-on-invalid-dep=yes" not in tokenize
    assert "#SBATCH --kill-on-invalid-dep=yes" in write.splitlines()
    assert "#SBATCH --kill-on-invalid-dep=yes" in merge.splitlines()


# -- the SLURM tier --------------------------------------------------------------------------


def sacct_states(job_id: str) -> list[str]:
    out = subprocess.run(
        ["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"],
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    return [s.split()[0] for s in out.split()] if out.strip() else []


def submitted(out: str) -> list[str]:
    return [line.split()[1].rstrip(":") for line in out.splitlines() if line.startswith("job ")]


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_conversion_as_job_arrays_reruns_its_failed_part_alone(tmp_path, jobs):
    folder = make_image_folder(tmp_path / "images", per_class=3)
    bad = sorted(folder.rglob("*.jpg"))[-1]  # in the last part's shards
    good = bad.read_bytes()
    bad.write_bytes(b"not an image")
    dest, logs = tmp_path / "out", tmp_path / "logs"
    logs.mkdir()
    args = [str(folder), str(dest), "--samples-per-shard", "2", "--val-fraction", "0.2"]
    slurm = ["--slurm", "--parts", "3", "--profile", "local-dev", "--log-dir", str(logs)]
    first = submitted(hpctrain("convert", *args, *slurm, "--max-parallel", "2").stdout)
    jobs.extend(first)
    assert len(first) == 2  # the write array and the merge
    # the failed part ends its array's dependency: the merge is cancelled, not left pending
    wait_for("the merge to be cancelled", lambda: "CANCELLED" in sacct_states(first[1]), 120)
    assert not (dest / "train" / "index.json").exists()
    records = sorted(p.name for p in (dest / ".hpctrain-parts").glob("write-*.json"))
    assert records == ["write-00000.json", "write-00001.json"]
    bad.write_bytes(good)
    again = hpctrain("convert", *args, *slurm, "--resume").stdout
    second = submitted(again)
    jobs.extend(second)
    assert len(second) == 2
    wait_for("the merge to finish", lambda: "COMPLETED" in sacct_states(second[1]), 180)
    array_log = sorted(logs.glob(f"hpctrain-convert-write-{second[0]}_*.out"))
    assert [p.name.rsplit("_", 1)[1] for p in array_log] == ["2.out"]  # part 2 alone
    one = tmp_path / "one"
    options = ["--samples-per-shard", "2", "--val-fraction", "0.2", "--progress", "none"]
    assert main(["convert", str(folder), str(one), *options]) == 0
    for split in ("train", "val"):
        a = json.loads((one / split / "index.json").read_text())
        b = json.loads((dest / split / "index.json").read_text())
        a.pop("command"), b.pop("command")
        assert a == b
        for shard in a["shards"]:
            name = shard["url"]
            assert (one / split / name).read_bytes() == (dest / split / name).read_bytes()
    assert not (dest / ".hpctrain-parts").exists()
    shutil.rmtree(logs)


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_a_failed_tokenize_stage_cancels_the_write_array_and_the_merge(tmp_path, jobs):
    """A stage before `write` that fails: every job after it is cancelled (before, the write
    array and the merge stayed pending for ever: DependencyNeverSatisfied)."""
    corpus, dest, logs = tmp_path / "corpus", tmp_path / "out", tmp_path / "logs"
    corpus.mkdir()
    logs.mkdir()
    (corpus / "a.txt").write_text("hello world\n")
    (corpus / "b.txt").write_bytes(b"not \xff\xfe UTF-8\n")  # its tokenize part fails (exit 3)
    slurm = ["--slurm", "--parts", "2", "--profile", "local-dev", "--log-dir", str(logs)]
    ids = submitted(
        hpctrain("convert", str(corpus), str(dest), "--tokenizer", "bytes", *slurm).stdout
    )
    jobs.extend(ids)
    assert len(ids) == 3  # tokenize, write, merge
    wait_for(
        "the write array and the merge to be cancelled",
        lambda: all("CANCELLED" in sacct_states(job) for job in ids[1:]),
        120,
    )
    # the failed array task's row may reach the accounting after its sibling's
    wait_for("the tokenize part to be listed FAILED", lambda: "FAILED" in sacct_states(ids[0]), 60)
    assert not (dest / "index.json").exists()


@pytest.mark.slurm
@pytest.mark.usefixtures("slurm_cluster")
def test_bench_convert_parts_runs_tiny(tmp_path, capsys):
    """`hpctrain bench convert-parts` as shipped, at a tiny size (tests/bench/test_every_bench.py
    names this test): both ways convert, the outputs are compared, the merge is timed."""
    from hpctrain.cli.main import main

    args = ["--mb", "1", "--file-kb", "100", "--parts", "2", "--workers", "1"]
    code = main(["bench", "convert-parts", *args, "--workdir", str(tmp_path), "--timeout", "300"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "outputs identical: True" in out and "goal: merge <=" in out, out
