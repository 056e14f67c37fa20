"""`hpctrain bench <what>`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib
import os

from hpctrain.errors import UsageError

HELP = "run a benchmark (ratios measured side by side in one run)"
EPILOG = "example: hpctrain bench convert --help"

# name -> (module with HELP, add_arguments(parser) and run(args) -> int, its HELP line). The
# line is repeated here so that `hpctrain bench --help` lists the benches without importing
# them: several import torch (seconds). tests/cli/test_main.py keeps both copies equal.
BENCHES: dict[str, tuple[str, str]] = {
    "checkpoint": (
        "hpctrain.bench.checkpoint",
        "checkpoint save throughput vs dd (random data, conv=fsync), time blocked per save, "
        "and what checksums cost on save and load",
    ),
    "convert": (
        "hpctrain.bench.convert",
        "images/s of tarfile, webdataset.ShardWriter and hpctrain convert; read cost of their "
        "shards",
    ),
    "trainer": (
        "hpctrain.bench.trainer",
        "Trainer step vs a hand-written PyTorch loop (paired ratios, A/A control), data wait",
    ),
    "loader": (
        "hpctrain.bench.loader",
        "loader throughput: decode limit vs ImageFolder, webdataset, LitData, Streaming and "
        "hpctrain; segmentation batches vs their limit (images/CPU-s)",
    ),
    "gpu-lm": (
        "hpctrain.bench.gpu_lm",
        "LLM training on this node's GPUs: tokens/s, MFU, peak memory, data wait",
    ),
    "import": (
        "hpctrain.bench.weights_import",
        "Hugging Face import: FSDP2 ranks reading their rows vs one process's load_state_dict",
    ),
    "mesh": (
        "hpctrain.bench.mesh",
        "HSDP (and TP) step vs flat FSDP2 on 4 gloo CPU ranks (paired ratios, A/A control)",
    ),
    "probe": (
        "hpctrain.bench.probe",
        "the health probe's gather of N peers on loopback: seconds of the hub, serial vs concurrent",
    ),
    "index": (
        "hpctrain.bench.index",
        "per-rank CPU and memory, and per-node bytes read, of index.json vs the compact index",
    ),
    "convert-parts": (
        "hpctrain.bench.convert_parts",
        "a token conversion as SLURM job arrays (--parts N) against one process (--workers W)",
    ),
    "lora": (
        "hpctrain.bench.lora",
        "LoRA (and QLoRA) fine-tune vs the full fine-tune: peak memory, step time, sizes",
    ),
    "generate": (
        "hpctrain.bench.generate",
        "greedy decoding: hpctrain's KV cache vs transformers' generate on one exported model",
    ),
    "attempts": (
        "hpctrain.bench.attempts",
        "records of one attempt at scale (per node vs per rank): files, bytes, seconds to decide",
    ),
}
# name -> the older names it still answers to (`bench gpu` ran the LLM case before `gpu-lm`)
ALIASES: dict[str, list[str]] = {"gpu-lm": ["gpu"]}


class BenchParser(argparse.ArgumentParser):
    """The parser of one bench, whose module is imported (and its arguments added) only when
    the command line reaches it: `hpctrain bench --help` imports none of them."""

    module_path = ""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def, override]
        if self.module_path:
            module = importlib.import_module(self.module_path)
            self.module_path = ""
            module.add_arguments(self)
            self.set_defaults(_bench_run=module.run)
        return super().parse_known_args(args, namespace)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", metavar="WHAT", parser_class=BenchParser)
    benches.required = True
    for name, (module_path, help_line) in BENCHES.items():
        sub = benches.add_parser(
            name, aliases=ALIASES.get(name, []), help=help_line, description=help_line
        )
        sub.module_path = module_path


def run(args: argparse.Namespace) -> int:
    for option in ("dir", "workdir", "work"):  # the folders benches write in (checkpoint, convert)
        folder = getattr(args, option, None)
        if folder:
            try:
                os.makedirs(folder, exist_ok=True)
            except OSError as exc:
                raise UsageError(
                    f"--{option} {folder}: cannot create: {exc.strerror or exc}"
                ) from None
    return int(args._bench_run(args))
