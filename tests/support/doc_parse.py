"""What the docs tier runs in place of a documented `hpctrain` command that cannot run here.

`python tests/support/doc_parse.py VERB WORDS...` takes the words the documented command gives
`hpctrain` (the shell has already expanded them, as it would for the real command) and checks
them as far as this machine can: the verb's own parser (an unknown flag or a missing argument
fails as `hpctrain` would fail), then, when the command names a YAML config, the config with
its overrides as `hpctrain config show` loads it and the LoRA rules, and for `submit`, `sbatch`
and `preflight` the job on its cluster profile (partition, QoS, time, account form,
precision). No torch is imported: a line costs a fraction of a second. Nothing runs, nothing is downloaded, nothing is submitted. A failure is one line
and the exit code of its kind, like hpctrain's own; success prints what was checked.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from hpctrain.cli.main import build_parser, parse_arguments, requested_verb
from hpctrain.config import load_config
from hpctrain.config.lora_rules import check_lora
from hpctrain.errors import HpctrainError
from hpctrain.launch.profiles import load_profile, resolve_job

SLURM_VERBS = ("submit", "sbatch", "preflight")


def check(argv: Sequence[str]) -> str:
    """What was checked of `hpctrain ARGV`, in words.

    Raises:
        SystemExit: the verb's parser refused the words (it printed why), or no verb.
        HpctrainError: the config, its rules or the job refused them.
    """
    verb = requested_verb(argv)
    if verb is None:
        raise SystemExit(f"doc_parse: no hpctrain verb in {' '.join(argv)!r}")
    args = parse_arguments(build_parser([verb]), list(argv))
    checked = [f"hpctrain {verb}: the command line parses"]
    config = getattr(args, "config", None)
    if not (isinstance(config, str) and config.endswith((".yaml", ".yml"))):
        return "; ".join(checked)  # a run folder or a checkpoint: made by a run, not here
    overrides = list(getattr(args, "overrides", None) or [])
    profile = getattr(args, "profile", None)
    if profile:
        overrides.append(f"slurm.profile={profile}")
    cfg = load_config(config, overrides)
    check_lora(cfg)
    checked.append(f"{config} with its overrides is a valid config")
    if verb in SLURM_VERBS:
        job = resolve_job(cfg, load_profile(cfg.slurm.profile))
        checked.append(f"the job resolves on {job.profile} ({job.nodes} node(s), {job.time})")
    return "; ".join(checked)


def main(argv: Sequence[str]) -> int:
    try:
        print(f"docs-test: {check(argv)} (not run)")
    except HpctrainError as exc:
        print(f"docs-test: hpctrain {' '.join(argv)}: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
