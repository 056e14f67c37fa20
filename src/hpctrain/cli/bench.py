"""`hpctrain bench <what>`: benchmarks that print ratios measured side by side in one run."""

from __future__ import annotations

import argparse
import importlib
import os

from hpctrain.errors import UsageError

HELP = "run a benchmark (ratios measured side by side in one run)"
EPILOG = "example: hpctrain bench convert --help"

# name -> module with HELP, add_arguments(parser), run(args) -> int
BENCHES: dict[str, str] = {
    "checkpoint": "hpctrain.bench.checkpoint",
    "convert": "hpctrain.bench.convert",
    "trainer": "hpctrain.bench.trainer",
    "loader": "hpctrain.bench.loader",
    "index": "hpctrain.bench.index",
    "convert-parts": "hpctrain.bench.convert_parts",
    "gpu-lm": "hpctrain.bench.gpu_lm",
    "import": "hpctrain.bench.weights_import",
    "mesh": "hpctrain.bench.mesh",
    "lora": "hpctrain.bench.lora",
    "generate": "hpctrain.bench.generate",
}
# name -> the older names it still answers to (`bench gpu` ran the LLM case before `gpu-lm`)
ALIASES: dict[str, list[str]] = {"gpu-lm": ["gpu"]}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    benches = parser.add_subparsers(dest="bench", metavar="WHAT")
    benches.required = True
    for name, module_path in BENCHES.items():
        module = importlib.import_module(module_path)
        sub = benches.add_parser(
            name, aliases=ALIASES.get(name, []), help=module.HELP, description=module.HELP
        )
        module.add_arguments(sub)
        sub.set_defaults(_bench_run=module.run)


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
