"""Entry point of the `hpctrain` command.

Each verb is a module `hpctrain.cli.<verb>` with `HELP` (one line), `EPILOG` (an example),
`add_arguments(parser)` and `run(args) -> int`, and optionally `interrupted(args) -> str`: what
Ctrl-C left behind and how to go on, for the one line it prints. Verbs listed here all work.

`hpctrain --help` and every `hpctrain VERB --help` answer in well under a second: a verb module
imports torch, numpy, fsspec or submitit only inside `run` (or, for what its arguments need,
inside `add_arguments`, which runs for the requested verb only); tests/cli checks it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import select
import signal
import sys
import traceback
from collections.abc import Sequence

from hpctrain import __version__
from hpctrain.config.load import is_override
from hpctrain.errors import HpctrainError, print_error_line, rank_tag

# Set by `hpctrain --debug`, so that the ranks `train --nproc` starts inherit it.
DEBUG_ENV = "HPCTRAIN_DEBUG"

# The exit status of a verb whose stdout reader went away (`hpctrain inspect D | head -1`):
# 128 + SIGPIPE, what the shell reports for a C tool such as `cat` killed by the same pipe, so
# that `set -o pipefail` scripts see the usual status; not 0, since the output was cut short.
EXIT_BROKEN_PIPE = 141
# Ctrl-C: 128 + SIGINT, as the shell reports it (hpctrain.train.preemption.INTERRUPT_EXIT_CODE,
# which the training loop returns after saving; not imported here: it would import torch).
EXIT_INTERRUPTED = 130

# Verbs whose first line comes after torch and the trainer are imported: 5-7 s on this 2-core
# machine, up to 12 s on a busy node. At a terminal they say so at once (`starting_line`).
SLOW_START = ("train", "eval", "predict", "generate", "export")

# Order is the order shown in `hpctrain --help`.
VERBS = [
    "train",
    "config",
    "plot",
    "export",
    "sync",
    "convert",
    "inspect",
    "index",
    "plan",
    "submit",
    "sbatch",
    "preflight",
    "status",
    "bench",
    "eval",
    "predict",
    "generate",
]


def build_parser(
    verbs_to_load: Sequence[str] = VERBS, *, with_arguments: bool = True
) -> argparse.ArgumentParser:
    """The parser with the given verbs (all of them for `hpctrain --help`).

    Without `with_arguments` the verbs get their help lines only: all that `hpctrain --help`
    (or a mistake before the verb) shows, without what a verb's arguments import.
    """
    parser = argparse.ArgumentParser(
        prog="hpctrain",
        description="Train PyTorch models on SLURM clusters from WebDataset shards.",
        epilog="example: hpctrain train configs/demo.yaml train.max_steps=100",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"hpctrain {__version__}")
    parser.add_argument(
        "--debug",
        dest="show_tracebacks",
        action="store_true",
        help=f"print the traceback of every error (the same as {DEBUG_ENV}=1)",
    )
    verbs = parser.add_subparsers(dest="verb", metavar="VERB")
    verbs.required = True
    for name in verbs_to_load:
        module = importlib.import_module(f"hpctrain.cli.{name.replace('-', '_')}")
        sub = verbs.add_parser(
            name,
            help=module.HELP,
            description=module.HELP,
            epilog=module.EPILOG,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        if with_arguments:
            module.add_arguments(sub)
        # `interrupted(args)`, where a verb has one: what Ctrl-C left, after "interrupted: "
        sub.set_defaults(_run=module.run, _interrupted=getattr(module, "interrupted", None))
    parser.set_defaults(_verb_parsers=verbs.choices)  # for parse_arguments
    return parser


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """`argv` parsed with options and `key=value` overrides in any order after the verb.

    Plain argparse stops filling a `KEY=VALUE...` list at the first option, so
    `train CONFIG --nproc 2 train.max_steps=7` would be refused; the verb's own parser reads
    its arguments intermixed instead.
    """
    verb = requested_verb(argv)
    if verb is None:  # --help, --version, or no verb: plain argparse says what is wrong
        return parser.parse_args(argv)
    at = list(argv).index(verb)
    head = argv[:at]
    if any(arg != "--debug" for arg in head):  # -h, --version or a mistake before the verb
        return parser.parse_args(argv)
    sub: argparse.ArgumentParser = parser.get_default("_verb_parsers")[verb]
    try:
        args = sub.parse_intermixed_args(argv[at + 1 :])
    except TypeError:  # a verb with verbs of its own (bench): argparse cannot intermix those
        return parser.parse_args(argv)
    args.verb = verb
    args.show_tracebacks = bool(head)
    return separate_overrides(args, sub)


def separate_overrides(
    args: argparse.Namespace, sub: argparse.ArgumentParser
) -> argparse.Namespace:
    """Overrides before the config path: argparse gives the first word to CONFIG (or SOURCE).

    A `key=value` word is never a path, so `train run_dir=runs/x configs/demo.yaml` trains
    configs/demo.yaml with the override; the overrides keep their order (the last one wins).
    """
    overrides = getattr(args, "overrides", None)
    for name in ("config", "source"):
        first = getattr(args, name, None)
        if not isinstance(first, str) or not isinstance(overrides, list):
            continue
        words = [first, *overrides]
        paths = [word for word in words if not is_override(word)]
        if not paths:
            sub.error(f"the following arguments are required: {name} (KEY=VALUE is an override)")
        setattr(args, name, words.pop(words.index(paths[0])))
        args.overrides = words  # a second path stays here, where it is refused as no key=value
    return args


def requested_verb(argv: Sequence[str]) -> str | None:
    """The verb on the command line, if it is one we know (the first non-option word)."""
    first = next((arg for arg in argv if not arg.startswith("-")), None)
    return first if first in VERBS else None


def main(argv: Sequence[str] | None = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    # Import only the verb asked for: some verbs import torch (seconds; BENCHMARKS.md), and
    # `hpctrain plan` or `hpctrain inspect` should not pay for it.
    verb = requested_verb(argv)
    if verb is None:  # `hpctrain --help`, --version, or a mistake: no verb's arguments needed
        parser = build_parser(VERBS, with_arguments=False)
    else:
        parser = build_parser([verb])
    args = parse_arguments(parser, argv)
    if args.show_tracebacks:
        os.environ[DEBUG_ENV] = "1"
    try:
        say_starting(args.verb)
        code = int(args._run(args))
    except HpctrainError as exc:
        # A mistake the user can fix: one line and the kind's exit code (hpctrain.errors).
        # Any other exception is a bug and keeps its traceback (exit code 1).
        if show_tracebacks(args):
            traceback.print_exc()
        tag = rank_tag() if args.verb in ("train", "eval", "predict") else ""
        print_error_line(args.verb, exc, tag=tag)
        code = exc.exit_code
    except KeyboardInterrupt:
        # Ctrl-C outside the training loop (which saves the step and says so itself): one
        # line and 130, as a shell reports it. What a verb writes goes to a temporary name
        # first (an export, a predictions part, convert's index last), so an interrupted one
        # leaves nothing a rerun would take for finished. A second Ctrl-C, while Python
        # shuts down (loader workers, threads), ends the process at once.
        if as_program:  # not when a test or a program calls main(argv) in-process
            signal.signal(signal.SIGINT, lambda *_: os._exit(EXIT_INTERRUPTED))
        if show_tracebacks(args):
            traceback.print_exc()
        if rank_tag().strip() in ("", "[rank 0]"):  # one line for a run of --nproc N ranks
            left = args._interrupted(args) if args._interrupted is not None else ""
            sys.stderr.write(f"hpctrain {args.verb}: interrupted{': ' + left if left else ''}\n")
            sys.stderr.flush()
        code = EXIT_INTERRUPTED
    except BrokenPipeError:
        if not stdout_reader_gone():
            raise  # another pipe (a worker, a socket): a bug, with its traceback
        return stdout_closed(EXIT_BROKEN_PIPE)
    try:
        sys.stdout.flush()  # here, not at interpreter shutdown, where it is a second traceback
    except BrokenPipeError:
        return stdout_closed(code or EXIT_BROKEN_PIPE)
    return code


def starting_line(verb: str) -> str | None:
    """What a slow-starting verb says before its imports, or None: only at a terminal (a
    person waiting; a SLURM log or a pipe gets nothing), once per command (not in each rank
    of a multi-process run: the command that started them says it)."""
    if verb not in SLOW_START or rank_tag() or not sys.stderr.isatty():
        return None
    return f"hpctrain: {verb}: loading torch and the trainer (a few seconds; longer on a busy node)"


def say_starting(verb: str) -> None:
    line = starting_line(verb)
    if line is not None:
        sys.stderr.write(line + "\n")
        sys.stderr.flush()


def stdout_reader_gone() -> bool:
    """Whether stdout is a pipe whose reading end is closed: POLLERR on its writing end
    (Linux), POLLHUP on some other systems."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        gone = select.POLLERR | select.POLLHUP
        return any(events & gone for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll (Windows), no descriptor (tests)
        return False


def stdout_closed(code: int) -> int:
    """End quietly: what is left in stdout's buffer goes to /dev/null, not to a second
    BrokenPipeError when Python flushes it at exit (as the `signal` module's docs advise)."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return code


def show_tracebacks(args: argparse.Namespace) -> bool:
    """`hpctrain --debug`, HPCTRAIN_DEBUG=1, or `hpctrain train --debug` (debug mode)."""
    in_debug_mode = args.verb == "train" and bool(getattr(args, "debug", False))
    return in_debug_mode or os.environ.get(DEBUG_ENV, "") not in ("", "0")


if __name__ == "__main__":
    raise SystemExit(main())
