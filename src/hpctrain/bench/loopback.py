"""A folder served over HTTP on loopback, with added latency and injected faults on demand.

Used by `hpctrain bench loader --remote` (in a process of its own: `serve_http_process`) and
by the remote-storage tests (in a thread, where they can schedule faults). Supports `Range`
requests; per-path fault schedules make the next requests of a file fail in chosen ways:
"503"/"403" (status), "reset" (headers with the full Content-Length, half the body, then a
TCP reset), "short" (no Content-Length, half the body, clean close: a silent truncation unless
the reader knows the size).
"""

from __future__ import annotations

import argparse
import http.server
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


@dataclass
class HttpLog:
    requests: list[tuple[str, str, str]] = field(default_factory=list)  # (path, range, action)
    faults: dict[str, list[str]] = field(default_factory=dict)  # path -> actions to come
    delay_s: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def next_action(self, path: str) -> str:
        with self.lock:
            todo = self.faults.get(path)
            return todo.pop(0) if todo else "ok"


def _handler(root: Path, log: HttpLog) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: Any) -> None:  # keep test output quiet
            pass

        def _file(self) -> Path | None:
            path = (root / self.path.split("?", 1)[0].lstrip("/")).resolve()
            return path if path.is_file() and root in path.parents else None

        def do_HEAD(self) -> None:
            path = self._file()
            if path is None:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Length", str(path.stat().st_size))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()

        def do_GET(self) -> None:
            if log.delay_s:
                time.sleep(log.delay_s)
            name = self.path.lstrip("/")
            action = log.next_action(name)
            log.requests.append((name, self.headers.get("Range", ""), action))
            if action in ("503", "403"):
                self.send_response(int(action))
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path = self._file()
            if path is None:
                self.send_error(404)
                return
            data = path.read_bytes()
            start = 0
            rng = self.headers.get("Range", "")
            if rng.startswith("bytes="):
                start = int(rng[6:].split("-", 1)[0])
            body = data[start:]
            if action == "short":
                self.send_response(206 if start else 200)
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body[: len(body) // 2])
                self.close_connection = True
                return
            self.send_response(206 if start else 200)
            if start:
                self.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Accept-Ranges", "bytes")
            self.end_headers()
            if action == "reset":
                self.wfile.write(body[: len(body) // 2])
                self.wfile.flush()
                # RST instead of FIN: SO_LINGER 0, as a dropped connection looks to clients
                self.connection.setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00"
                )
                self.close_connection = True
                return
            self.wfile.write(body)

    return Handler


@contextmanager
def serve_http(root: Path, *, delay_s: float = 0.0) -> Iterator[tuple[str, HttpLog]]:
    """Serve `root` on 127.0.0.1 (a free port); yields (base URL, request log / fault plan)."""
    log = HttpLog(delay_s=delay_s)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler(root.resolve(), log))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", log
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


@contextmanager
def serve_http_process(root: Path, *, delay_s: float = 0.0) -> Iterator[tuple[str, int]]:
    """`serve_http` in a process of its own, as a storage server is: yields (base URL, pid).

    It serves until its standard input closes, so it never outlives this process."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "hpctrain.bench.loopback", str(root), "--delay-s", str(delay_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None
        url = proc.stdout.readline().strip()
        if not url.startswith("http://"):
            raise RuntimeError(f"the loopback HTTP server did not start (got {url!r})")
        yield url, proc.pid
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="serve a folder over HTTP on 127.0.0.1")
    parser.add_argument("root", type=Path)
    parser.add_argument("--delay-s", type=float, default=0.0, help="added to every GET")
    args = parser.parse_args(argv)
    with serve_http(args.root, delay_s=args.delay_s) as (url, _log):
        print(url, flush=True)
        sys.stdin.read()  # until the parent closes it (or ends)


if __name__ == "__main__":
    main()
