"""Servers on loopback for the remote-storage tests: HTTP (`hpctrain.data.loopback`, with
faults on demand) and S3 (moto's `ThreadedMotoServer`, with fsspec options for it)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpctrain.data.loopback import HttpLog, serve_http

__all__ = ["HttpLog", "make_bucket", "serve_http", "serve_s3"]


@contextmanager
def serve_s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback; yields fsspec `storage_options` pointing at it."""
    from moto.server import ThreadedMotoServer

    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        os.environ.setdefault(name, "testing")
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield {
            "key": "testing",
            "secret": "testing",
            "client_kwargs": {"endpoint_url": f"http://{host}:{port}", "region_name": "us-east-1"},
        }
    finally:
        server.stop()


def make_bucket(options: dict[str, Any], name: str) -> None:
    """Create a bucket on the moto server (s3fs's mkdir sends a location moto refuses)."""
    import boto3

    boto3.client(
        "s3",
        endpoint_url=options["client_kwargs"]["endpoint_url"],
        region_name="us-east-1",
        aws_access_key_id=options["key"],
        aws_secret_access_key=options["secret"],
    ).create_bucket(Bucket=name)
