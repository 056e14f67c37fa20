"""`test_remote`'s HTTP and S3 tests with the compact index forced (see test_compact_forced.py):
the companion is derived on the node (HTTP cannot be written) or written beside the JSON (S3)."""

from __future__ import annotations

from tests.data.test_remote import (  # noqa: F401  (tests and fixtures run here again)
    pytestmark,
    shards,
    test_http_streams_the_same_batches_as_local_disk,
    test_s3_through_fsspec,
)
from tests.support.compact_kit import compact_forced, every_index_is_compact  # noqa: F401
