"""Local servers for tests (a plain module, not a conftest: import what you need).

    from tests.support.local_servers import moto_s3_server, s3_environment

    with moto_s3_server() as endpoint, s3_environment(endpoint):
        fs = fsspec.filesystem("s3"); fs.mkdir("bucket")  # s3fs now talks to the local server

Everything listens on 127.0.0.1 only, on a free port; nothing reaches the network.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

S3_KEY = "testing"
S3_SECRET = "testing"
S3_REGION = "us-east-1"


@contextlib.contextmanager
def moto_s3_server() -> Iterator[str]:
    """Run moto's S3-protocol server in a thread; yield its endpoint URL (http://127.0.0.1:PORT)."""
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # 0: no port race
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def s3_storage_options(endpoint: str) -> dict[str, object]:
    """fsspec/s3fs keyword arguments for the server at `endpoint` (for APIs taking storage_options)."""
    return {
        "key": S3_KEY,
        "secret": S3_SECRET,
        "client_kwargs": {"endpoint_url": endpoint, "region_name": S3_REGION},
    }


@contextlib.contextmanager
def s3_environment(endpoint: str) -> Iterator[None]:
    """Point every s3fs/boto client created inside (and in child processes) at `endpoint`.

    Uses the standard AWS variables (`AWS_ENDPOINT_URL` is honoured by botocore >= 1.31), so code
    under test needs no test-only options. s3fs caches filesystem instances: the cache is
    cleared on entry and exit so no client outlives its server.
    """
    values = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": S3_KEY,
        "AWS_SECRET_ACCESS_KEY": S3_SECRET,
        "AWS_DEFAULT_REGION": S3_REGION,
    }
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)

    def clear_cache() -> None:
        import s3fs

        s3fs.S3FileSystem.clear_instance_cache()

    clear_cache()
    try:
        yield
    finally:
        clear_cache()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
