"""Checks on every value that reaches a job script, a submitit folder or a log.

Three kinds of field: SLURM tokens (account, partition, QoS...) take a narrow character set;
paths take a slightly wider one plus `$SCRATCH`-style variables and are rendered in double
quotes; free arguments (config overrides) are single-quoted by `shlex.quote`. A newline is
refused everywhere: in an `#SBATCH` line it would start a new shell line. Credentials (URL
user:password@, signed-URL query strings, secret environment variables) are refused so they
are never written to a script, a pickled job or a log.
"""

from __future__ import annotations

import re

from hpctrain.launch.profiles import LaunchError

_TOKEN = re.compile(r"^[A-Za-z0-9_.@:+,=/%-]+$")
_CONSTRAINT = re.compile(r"^[A-Za-z0-9_.@:+,=/%&|\[\]*-]+$")
_PATH_CHARS = re.compile(r"^[A-Za-z0-9_.@:+,=/%~-]*$")
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}|\$([A-Za-z_][A-Za-z0-9_]*)")

# Variables a path may reference; they are expanded by the job's shell on the compute node.
PATH_VARIABLES = frozenset(
    {"SCRATCH", "WORK", "STORE", "JOBSCRATCH", "DSDIR", "HOME", "USER", "TMPDIR",
     "SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_ARRAY_TASK_ID", "SLURM_SUBMIT_DIR",
     "SINGULARITY_ALLOWED_DIR"}  # Jean Zay's folder of runnable container images
)  # fmt: skip

_SECRET_QUERY = re.compile(
    r"[?&](?:x-amz-[a-z-]+|sig|signature|token|access_token|api_key|apikey|key|password|sv|se)=",
    re.IGNORECASE,
)
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@")
_SECRET_ENV = re.compile(
    r"\b[A-Z0-9_]*(?:SECRET|TOKEN|PASSWORD|PASSWD|API_KEY|ACCESS_KEY)[A-Z0-9_]*\s*=",
)


def _no_control(value: str, key: str) -> None:
    if any(ch in value for ch in "\n\r\x00"):
        raise LaunchError(f"{key}={value!r}: newlines and NUL characters are not allowed")


def check_token(value: str, key: str, *, constraint: bool = False) -> str:
    """A SLURM option value (account, partition, QoS, job name, constraint)."""
    _no_control(value, key)
    pattern = _CONSTRAINT if constraint else _TOKEN
    if not pattern.match(value):
        allowed = "letters, digits and _ . @ : + , = / % -" + (" & | [ ] *" if constraint else "")
        raise LaunchError(f"{key}={value!r}: only {allowed} are allowed here")
    return value


def check_path(value: str, key: str) -> str:
    """A path rendered inside double quotes: plain characters and known `$VARIABLES` only."""
    _no_control(value, key)
    for match in _VARIABLE.finditer(value):
        name = match.group(1) or match.group(2)
        if name not in PATH_VARIABLES:
            raise LaunchError(
                f"{key}={value!r}: ${name} is not allowed in a path (allowed: {', '.join(sorted('$' + v for v in PATH_VARIABLES))})"
            )
    plain = _VARIABLE.sub("", value)
    if not _PATH_CHARS.match(plain):
        raise LaunchError(
            f"{key}={value!r}: only letters, digits, _ . @ : + , = / % ~ - and $VARIABLES are allowed in a path"
        )
    return value


def find_credential(value: str) -> str | None:
    """Why `value` looks like it holds a credential, or None."""
    if _URL_USERINFO.search(value):
        return "a URL with user:password@"
    if _SECRET_QUERY.search(value):
        return "a URL with a token or signature in its query string"
    if _SECRET_ENV.search(value):
        return "a secret environment variable"
    return None


def check_no_credential(value: str, key: str) -> str:
    reason = find_credential(value)
    if reason is not None:
        # Never echo the value itself: it is the secret.
        raise LaunchError(
            f"{key} holds {reason}; pass credentials through the environment or fsspec's config, not the config or the job script"
        )
    return value


def check_argument(value: str, key: str) -> str:
    """A free command-line argument (shell-quoted when rendered): no newline, no credential."""
    _no_control(value, key)
    return check_no_credential(value, key)


def check_setup_line(value: str, key: str) -> str:
    """A shell line run before training (module load ...): one line, no credential."""
    _no_control(value, key)
    return check_no_credential(value, key)
