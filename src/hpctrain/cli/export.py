"""`hpctrain export RUN_DIR_OR_CHECKPOINT OUT.pt`."""

from __future__ import annotations

import argparse

HELP = "write a checkpoint's model as a consolidated weights-only state dict (DDP or FSDP2)"
EPILOG = """examples:
  hpctrain export runs/demo model.pt                        # newest checkpoint of the run
  hpctrain export runs/demo/checkpoints/step-400 model.pt   # one checkpoint
Load it with: model.load_state_dict(torch.load("model.pt", weights_only=True))"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source", help="run folder, checkpoint folder, or one step-<N> checkpoint (path or URL)"
    )
    parser.add_argument("out", help="the .pt file to write")


def run(args: argparse.Namespace) -> int:
    from hpctrain.train.export import export_weights

    result = export_weights(args.source, args.out)  # CheckpointError: exit code 4
    print(
        f"exported {result.source} (step {result.step}): {result.num_tensors} tensors, "
        f"{result.num_elements:,} values -> {result.out}"
    )
    return 0
