"""The plan and resume tests again, with the compact index forced (issue #42).

`HPCTRAIN_INDEX_FORM=compact`: every index these tests open is read through its companion
(`index.compact`, derived beside the JSON when missing, copied to a node-local folder and
mapped), in this process and in the rank processes they start. The tests are the ones of
`test_loader`, `test_mixture_loader`, `test_sequences` and `test_plan_cli` (and `test_remote`'s
HTTP and S3 ones in `test_compact_forced_remote.py`), imported unchanged:
they must give the same batches, states and plans as with `index.json`.
"""

from __future__ import annotations

from hpctrain.data.compact import CompactShards
from hpctrain.data.mixture_index import ChainedShards
from tests.data.test_loader import (  # noqa: F401  (tests and fixtures run here again)
    shards,
    test_batches_hold_every_field_uint8_images_labels_keys_in_plan_order,
    test_elastic_resume_sees_every_sample_once,
    test_exact_resume_gives_identical_remaining_batches,
    test_state_saved_after_the_last_batch_resumes_into_the_next_epoch,
)
from tests.data.test_mixture_loader import (  # noqa: F401
    test_exact_elastic_and_reweighted_resume,
    test_exposure_per_source_matches_the_plan,
    test_token_sources_mix_as_packed_sequences,
    two_ranks,
)
from tests.data.test_plan_cli import (  # noqa: F401
    test_plan_json_lists_every_stream,
    test_plan_of_a_mixture_prints_the_realized_mixture_per_rank,
    test_plan_text_and_rank_detail,
)
from tests.data.test_sequences import (  # noqa: F401
    test_elastic_resume_two_ranks_to_one_sees_every_sequence_once,
    test_loader_batches_follow_the_plan_with_counts_from_num_tokens,
    test_plan_cli_shows_sequences_and_dropped_tokens,
    tokens,
)
from tests.support.compact_kit import compact_forced, every_index_is_compact  # noqa: F401


def test_a_mixture_chains_compact_sources(tmp_path):
    from hpctrain.config.schema import SourceConfig
    from hpctrain.data.mixture_index import open_mixture
    from tests.data.test_mixture_loader import make_source

    make_source(tmp_path / "a", [3, 4], 0)
    make_source(tmp_path / "b", [5], 100)
    index = open_mixture([SourceConfig(path=str(tmp_path / n)) for n in "ab"])
    assert isinstance(index.shards, ChainedShards)
    assert all(isinstance(i.shards, CompactShards) for i in index.shards.indexes)
    assert index.shard_url(2) == str(tmp_path / "b" / "train-000000.tar")
    assert index.counts("num_samples").tolist() == [3, 4, 5]
