"""Servers on loopback for the remote-storage tests: HTTP (`hpctrain.bench.loopback`, with
faults on demand) and S3 (moto's `ThreadedMotoServer`, with fsspec options for it)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from hpctrain.bench.loopback import HttpLog, serve_http
from tests.support.local_servers import moto_s3_server, s3_storage_options

__all__ = ["HttpLog", "make_bucket", "serve_http", "serve_s3"]


@contextmanager
def serve_s3() -> Iterator[dict[str, Any]]:
    """moto's S3 server on loopback; yields fsspec `storage_options` pointing at it."""
    with moto_s3_server() as endpoint:
        yield s3_storage_options(endpoint)


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
