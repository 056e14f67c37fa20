"""`hpctrain sync RUN_DIR`: upload a run's offline W&B runs (on a node with internet)."""

from __future__ import annotations

import argparse
import importlib.util
import shlex
import subprocess
import sys
from pathlib import Path

from hpctrain.errors import UsageError, install_hint

HELP = "upload the offline W&B runs of a run folder (run it on a login node: it needs internet)"
EPILOG = """examples:
  hpctrain sync runs/demo             # every start of the run, as one W&B run
  hpctrain sync runs/demo --dry-run   # list what would be uploaded"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run_dir", help="run folder of a run with logging.wandb=offline")
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would be uploaded, upload nothing"
    )


def run(args: argparse.Namespace) -> int:
    """Exit status: wandb sync's (0 when everything was uploaded)."""
    from hpctrain.observe.trackers import wandb_sync_command

    if importlib.util.find_spec("wandb") is None:
        raise UsageError(f"hpctrain sync needs the wandb package: {install_hint('wandb')}")
    command = wandb_sync_command(Path(args.run_dir), dry_run=args.dry_run)
    # The same command as `python -m wandb` of this environment, in the form users type.
    print(shlex.join(["wandb", *command[3:]]), flush=True)
    code = subprocess.run(command, check=False).returncode
    if code != 0:
        print(f"hpctrain sync: wandb sync exited with {code}", file=sys.stderr)
    return code
