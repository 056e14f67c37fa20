"""`hpctrain bench gpu`, the LLM case, without a GPU: the preset choice, the config, a CPU run.

No GPU is lent to CI: the CUDA half (bf16, compile, FSDP2 over several GPUs) is the same
`causal_lm` path the training tests run on CPU with gloo; here the benchmark's own parts run
for real on the CPU (`--device cpu`: fp32, no compile), the GPU decisions as pure functions.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from hpctrain.bench import gpu_lm
from hpctrain.config import load_config
from hpctrain.data.index import read_index
from hpctrain.data.unigram import count_tokens


@pytest.fixture(scope="module")
def shapes() -> list[gpu_lm.PresetShape]:
    return gpu_lm.preset_shapes(32768)


def choose(shapes: list[gpu_lm.PresetShape], memory_gib: float, ranks: int, preset: str = "auto"):
    shape, checkpointing, _ = gpu_lm.choose_preset(
        shapes, memory_gib, batch_size=8, seq_len=2048, num_ranks=ranks, preset=preset
    )
    return shape.name, checkpointing


def test_largest_preset_that_fits(shapes: list[gpu_lm.PresetShape]) -> None:
    names = [s.name for s in shapes]
    assert names[0] == "gpt-tiny" and "gpt-1b" in names and "gpt-8b" in names
    one_b = next(s for s in shapes if s.name == "gpt-1b")
    assert 1.0e9 < one_b.num_parameters < 1.1e9  # Llama 3.2 1B's shape, 32k vocabulary
    # 8B on one GPU: 16 bytes per parameter of fp32 state alone exceed an H200's 141 GB.
    assert choose(shapes, 139.8, 1) == ("gpt-3b", True)
    assert choose(shapes, 139.8, 1, "gpt-1b") == ("gpt-1b", False)
    # Four 80 GB H100 (a Jean Zay gpu_p6 node): FSDP2 divides the state by four.
    assert choose(shapes, 79.6, 4) == ("gpt-8b", True)
    assert choose(shapes, 40, 1) == ("gpt-1b", True)
    with pytest.raises(ValueError, match="no GPT preset"):
        choose(shapes, 2, 1)
    with pytest.raises(ValueError, match="--preset gpt-2: not a GPT preset"):
        choose(shapes, 80, 1, "gpt-2")


def test_memory_estimate_grows_with_what_it_holds(shapes: list[gpu_lm.PresetShape]) -> None:
    one_b = next(s for s in shapes if s.name == "gpt-1b")

    def estimate(**kw) -> float:
        args = {"batch_size": 8, "seq_len": 2048, "num_ranks": 1, "activation_checkpointing": False}
        return gpu_lm.estimate_memory_gib(one_b, **{**args, **kw})

    assert estimate(activation_checkpointing=True) < estimate()
    assert estimate(num_ranks=4) < estimate()
    assert estimate(batch_size=16) > estimate()
    # fp32 weights, gradients and AdamW moments: 16 bytes per parameter, at least.
    assert estimate(batch_size=1, seq_len=1) > 16 * one_b.num_parameters / 2**30


def test_gpu_config_is_valid(tmp_path: Path) -> None:
    plan = gpu_lm.LMPlan(
        device="cuda",
        num_gpus=4,
        gpu_name="NVIDIA H100 80GB HBM3",
        preset="gpt-8b",
        num_parameters=7_248_023_552,
        vocab_size=32768,
        precision="bf16",
        strategy="fsdp",
        compile=True,
        activation_checkpointing=True,
        batch_size=8,
        seq_len=2048,
        workers_per_rank=8,
        estimated_memory_gib=45.1,
        memory_gib=79.6,
        peak_tflops=989.0,
    )
    cfg = load_config(None, gpu_lm.config_overrides(plan, tmp_path / "index.json", tmp_path, 100))
    assert (cfg.task, cfg.model.name, cfg.data.seq_len) == ("causal_lm", "gpt-8b", 2048)
    assert (cfg.train.strategy, cfg.train.precision) == ("fsdp", "bf16")
    assert cfg.train.compile and cfg.train.activation_checkpointing
    assert cfg.checkpoint.every_steps == 0 and not cfg.data.val
    import dataclasses

    for changes, expected in (({"strategy": "hsdp"}, ("hsdp", 1)), ({"tp_degree": 2}, ("fsdp", 2))):
        mesh = dataclasses.replace(plan, **changes)
        cfg = load_config(None, gpu_lm.config_overrides(mesh, tmp_path / "index.json", tmp_path, 1))
        assert (cfg.train.strategy, cfg.train.tp_degree) == expected


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_cpu_run_reports_tokens_and_data_wait(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    gpu_lm.add_arguments(parser)
    args = parser.parse_args(
        [
            *("--device", "cpu", "--preset", "gpt-tiny", "--steps", "2"),
            *("--seq-len", "32", "--batch-size", "2", "--vocab-size", "300"),
            *("--workers", "0", "--work", str(tmp_path)),
        ]
    )
    assert gpu_lm.run(args) == 0
    index = read_index(str(tmp_path / "shards" / "index.json"))
    assert index.tokenizer == {
        "name": "random-300",
        "vocab_size": 300,
        "eod_id": 299,
        "sha256": "",
    }
    counts = count_tokens(index, "random shards")  # every id in the vocabulary, counts agree
    assert counts[299] == index.num_samples  # one end-of-document id per document
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["plan"]["preset"] == "gpt-tiny" and report["plan"]["precision"] == "fp32"
    assert report["tokens_per_s"] > 0 and 0 <= report["data_wait_fraction"] <= 1
    assert report["mfu"] is None  # a CPU has no entry in the peak table
    assert report["steps_measured"] == 1  # the first logged step is warm-up
    assert report["train_gflops_per_token"] > 0
    # No final checkpoint: a benchmark's weights are thrown away (#38 item 11).
    assert list((tmp_path / "run" / "checkpoints").glob("step-*")) == []
    text = gpu_lm.format_report(report)
    assert "tokens/s" in text and "data wait" in text and "MFU:             n/a" in text


def test_refusals_are_usage_errors(tmp_path: Path) -> None:
    from hpctrain.errors import UsageError

    parser = argparse.ArgumentParser()
    gpu_lm.add_arguments(parser)
    args = parser.parse_args(["--device", "cpu", "--preset", "gpt-2", "--work", str(tmp_path)])
    with pytest.raises(UsageError, match="--preset gpt-2: not a GPT preset"):
        gpu_lm.make_lm_plan(args)


@pytest.mark.parametrize("name", ["gpu-lm", "gpu"])  # `gpu`: the older name, kept for scripts
def test_cli_names_run_the_llm_case(name: str) -> None:
    from hpctrain.cli.main import build_parser, parse_arguments

    args = parse_arguments(build_parser(["bench"]), ["bench", name, "--device", "cpu"])
    assert args._bench_run is gpu_lm.run and args.device == "cpu"
