"""The fork server of an allocation (resilience/forkserver.py): ranks forked from a warm
process keep what a fresh start gives them, and end as a fresh rank would.

A real server runs here (a subprocess, `--preload` with a test module instead of torch, so
each test takes a fraction of a second), and a real watcher where the watcher's part is
tested; the child is tests/support/forkserver_child.py. Nothing here needs a GPU; what a GPU
changes (the step's GPUs must match the server's) is tested as the refusal it is.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from hpctrain.resilience import forked
from hpctrain.resilience.forked import ForkedChild, start
from hpctrain.resilience.node_records import read_rank_records

pytestmark = pytest.mark.slow  # a server and its children, a watcher: processes

REPO = Path(__file__).resolve().parents[2]
CHILD = "tests.support.forkserver_child"


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """The job's variables a server and its watchers share (so the same socket name)."""
    env = {**os.environ, "SLURM_JOB_ID": f"test{os.getpid()}{tmp_path.name}",
           "SLURMD_NODENAME": "tnode", "SLURM_RESTART_COUNT": "0",
           "PYTHONPATH": os.pathsep.join([str(REPO / "src"), str(REPO)])}  # fmt: skip
    for name in ("SLURM_STEP_GPUS", "SLURM_JOB_GPUS", "SLURM_PROCID", forked.ENABLED_ENV):
        env.pop(name, None)
    return {**env, **extra}


def _line(stream: object, timeout: float = 60) -> str:
    """The next line of a pipe, or fail after `timeout` seconds (a bound, not a measure)."""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()  # type: ignore[attr-defined]
    data = b""
    while not data.endswith(b"\n"):
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"no line within {timeout} s (so far {data!r})")
        chunk = os.read(fd, 1)
        if not chunk:
            raise AssertionError(f"the pipe closed (so far {data!r})")
        data += chunk
    return data.decode()


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    return state == "Z"  # a zombie has ended: only its parent's wait is left


def _wait(what: str, check: object, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.05)


class Server:
    def __init__(self, tmp_path: Path, preload: str, **extra: str) -> None:
        self.env = _env(tmp_path, **extra)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "hpctrain.resilience.forkserver", "--preload", preload],
            cwd=REPO, env=self.env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        line = _line(self.proc.stderr)
        assert "fork server on tnode: ready in" in line, line

    def client_env(self, **extra: str) -> dict[str, str]:
        return {**self.env, forked.ENABLED_ENV: "1", **extra}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(30)
        assert self.proc.stderr is not None
        self.proc.stderr.close()


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server for the tests that leave it running."""
    found = Server(tmp_path_factory.mktemp("shared"), "tests.support.forkserver_preloaded")
    yield found
    found.close()


@pytest.fixture
def server(tmp_path: Path) -> Iterator[Server]:
    """A server of the test's own, for the tests that end it."""
    found = Server(tmp_path, "tests.support.forkserver_preloaded")
    yield found
    found.close()


def watcher(server: Server, attempt_dir: Path, *args: str, **extra: str) -> subprocess.Popen[str]:
    """The real watcher of rank 0, its rank `python -m CHILD ARGS`, its stdout a pipe."""
    attempt_dir.mkdir(exist_ok=True)
    code = ("import sys; from pathlib import Path; from hpctrain.resilience.watch import Watcher; "
            f"sys.exit(Watcher(Path(sys.argv[1]), [sys.executable, '-m', {CHILD!r}, "
            "*sys.argv[2:]]).run())")  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-c", code, str(attempt_dir), *args], cwd=REPO,
        env=server.client_env(**extra), stdout=subprocess.PIPE, text=True,
    )  # fmt: skip


def record(attempt_dir: Path) -> dict:
    """Rank 0's record, from its node's (`node-tnode.json`: the watcher's)."""
    return read_rank_records(attempt_dir, ["tnode"], 1)[0]


def test_a_forked_rank_runs_with_its_arguments_environment_folder_and_stdio(
    shared: Server, tmp_path: Path, capfd: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """Its arguments, the environment it is given (the rank's, not the server's), the
    watcher's folder, umask and CPUs, and its stdout/stderr; its exit status comes back."""
    monkeypatch.chdir(tmp_path)
    old_mask = os.umask(0o027)
    try:
        child = start([sys.executable, "-m", CHILD, "report", "7"],
                      env=shared.client_env(SLURM_PROCID="3", FORKSERVER_TEST="mine"))  # fmt: skip
        assert isinstance(child, ForkedChild)
        status = child.wait()
    finally:
        os.umask(old_mask)
    out, err = capfd.readouterr()
    report = json.loads(out)
    assert status == child.returncode == 7
    assert report["argv"] == ["report", "7"]
    assert (report["pid"], report["parent"]) == (child.pid, shared.proc.pid)  # forked there
    assert report["preloaded"]  # what the server imported is there already
    assert (report["procid"], report["mine"]) == ("3", "mine")
    assert (report["cwd"], report["umask"]) == (str(tmp_path), 0o027)
    assert report["cpus"] == sorted(os.sched_getaffinity(0))
    assert report["pgid"] == child.pid  # its own group: signals reach its workers too
    assert err == "a line on stderr\n"


def test_the_signals_a_watcher_notes_reach_its_forked_rank(shared: Server, tmp_path: Path) -> None:
    """SLURM signals the training step, which the forked rank is no process of: the watcher
    forwards USR2 (the time limit's warning) and TERM; the rank's own exit status is kept."""
    folder = tmp_path / "attempt"
    proc = watcher(shared, folder, "signals")
    assert _line(proc.stdout) == "ready\n"
    proc.send_signal(signal.SIGUSR2)
    assert _line(proc.stdout) == "got SIGUSR2\n"
    proc.send_signal(signal.SIGTERM)
    assert _line(proc.stdout) == "got SIGTERM\n"
    assert proc.wait(60) == 0
    rank = record(folder)
    assert (rank["exit_code"], rank["signal"]) == (0, None)
    assert rank["received"] == ["SIGUSR2", "SIGTERM"]
    assert _gone(rank["pid"])


def test_a_forked_rank_dies_with_its_watcher(shared: Server, tmp_path: Path) -> None:
    """srun's SIGKILL of the step reaches the watcher only: its rank goes too."""
    folder = tmp_path / "attempt"
    proc = watcher(shared, folder, "sleep")
    assert _line(proc.stdout) == "ready\n"
    pid = record(folder)["pid"]
    proc.kill()
    proc.wait(60)
    _wait("the rank to end with its watcher", lambda: _gone(pid))
    assert shared.proc.poll() is None  # the server serves on


def test_a_forked_rank_dies_with_its_server_and_its_watcher_says_sigkill(
    server: Server, tmp_path: Path
) -> None:
    folder = tmp_path / "attempt"
    proc = watcher(server, folder, "sleep")
    assert _line(proc.stdout) == "ready\n"
    pid = record(folder)["pid"]
    server.proc.kill()
    assert proc.wait(60) == 128 + signal.SIGKILL
    assert record(folder)["signal"] == signal.SIGKILL
    _wait("the rank to end with its server", lambda: _gone(pid))


def test_a_term_ends_the_server_only_once_its_ranks_have_ended(
    server: Server, tmp_path: Path
) -> None:
    """A preemption's TERM reaches every step: the ranks save and exit first; the server
    must not take them down with it."""
    folder = tmp_path / "attempt"
    proc = watcher(server, folder, "signals")
    assert _line(proc.stdout) == "ready\n"
    server.proc.send_signal(signal.SIGTERM)
    server.proc.send_signal(signal.SIGUSR2)  # the time limit's warning: ignored
    proc.send_signal(signal.SIGUSR2)
    assert _line(proc.stdout) == "got SIGUSR2\n"  # the rank still runs
    assert server.proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert server.proc.wait(60) == 0


def test_a_rank_whose_gpus_differ_from_the_servers_starts_afresh(
    shared: Server, capfd: pytest.CaptureFixture[str]
) -> None:
    """The rank's CUDA_VISIBLE_DEVICES counts from its step's GPUs: forked from a server
    whose step has other GPUs, it would mean other devices (no GPU is used here: the
    decision is on SLURM's variables)."""
    lines: list[str] = []
    child = start([sys.executable, "-m", CHILD, "report", "0"],
                  env=shared.client_env(SLURM_STEP_GPUS="0,1"), say=lines.append)  # fmt: skip
    assert isinstance(child, subprocess.Popen)
    assert child.wait(60) == 0
    assert json.loads(capfd.readouterr().out)["parent"] == os.getpid()  # a fresh start
    (line,) = lines
    assert "the rank's step has GPUs 0,1, the fork server's none" in line, line
    assert line.endswith("this rank starts afresh")


def test_a_server_with_a_thread_running_starts_ranks_afresh(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    """A fork copies only the thread that forks: a preloaded module that started one (and
    might hold a lock in it) makes the server refuse."""
    found = Server(tmp_path, "tests.support.forkserver_thread")
    try:
        lines: list[str] = []
        child = start([sys.executable, "-m", CHILD, "report", "0"], env=found.client_env(),
                      say=lines.append)  # fmt: skip
        assert isinstance(child, subprocess.Popen) and child.wait(60) == 0
        assert "threads run in the fork server" in lines[0], lines
    finally:
        found.close()


def test_without_a_server_a_rank_starts_afresh(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    command = [sys.executable, "-m", CHILD, "report", "0"]
    lines: list[str] = []
    child = start(command, env=_env(tmp_path), say=lines.append)  # the job runs none
    assert isinstance(child, subprocess.Popen) and child.wait(60) == 0 and not lines
    monkeypatch.setattr(forked, "CONNECT_WAIT_S", 0.2)
    env = {**_env(tmp_path), forked.ENABLED_ENV: "1"}  # one was asked for, none listens
    child = start(command, env=env, say=lines.append)
    assert isinstance(child, subprocess.Popen) and child.wait(60) == 0
    assert "Connection refused; this rank starts afresh" in lines[0], lines
