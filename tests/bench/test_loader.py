"""`hpctrain bench loader` runs end to end (tiny sizes; the figures are in BENCHMARKS.md)."""

from __future__ import annotations

import importlib
import json
import re
import sys

import pytest
import torch

from hpctrain.bench import loader as bench
from hpctrain.bench import loader_peers as peers
from hpctrain.bench.loader_setup import SegmentationTransform, prepare, synthetic_images
from hpctrain.cli.main import main
from hpctrain.errors import UsageError, install_hint

# limit, side by side, ImageFolder, webdataset, hpctrain x2, segmentation x2, remote x3
HPCTRAIN_CASES = 11


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@pytest.fixture
def no_peers(monkeypatch):
    """The peer libraries made unimportable, as in CI (which does not install them)."""
    for peer in peers.PEERS:
        monkeypatch.setitem(sys.modules, peer.module, None)


@pytest.fixture
def setup(tmp_path):
    torch.set_num_threads(1)
    images = synthetic_images(20)
    return prepare(tmp_path, images, batch_size=8, workers=1, crop=32)


@pytest.mark.slow  # seconds (subprocesses, a trained run): out of make test-fast (#49)
def test_bench_loader_runs_all_cases(capsys, no_peers):
    args = ["bench", "loader", "--images", "24", "--rounds", "1", "--workers", "1"]
    assert (
        main(
            [*args, "--batch-size", "8", "--crop", "32", "--remote", "--latency-ms", "1", "--json"]
        )
        == 0
    )
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert len(out["cases"]) == HPCTRAIN_CASES
    assert all(v["images_per_cpu_s"] > 0 for v in out["cases"].values())
    assert "hpctrain / webdataset (images per CPU-s)" in out["ratios"]
    segmentation = "hpctrain segmentation steady state / segmentation limit (images per CPU-s)"
    assert segmentation in out["ratios"]
    # the peers are skipped with a line each, on stderr so that stdout stays JSON
    assert set(out["meta"]["skipped"]) == {peer.name for peer in peers.PEERS}
    for peer in peers.PEERS:
        assert f"{peer.name}: skipped, {peer.module} is not installed" in captured.err
        assert install_hint("bench") in captured.err


def test_missing_peer_is_skipped_with_a_line(capsys, no_peers):
    skipped = peers.missing_peers()
    assert set(skipped) == {peers.LITDATA, peers.STREAMING}
    assert "litdata is not installed" in skipped[peers.LITDATA]
    summary = {
        name: {
            "images_per_s": 100.0,
            "images_per_cpu_s": 50.0,
            "images_per_s_range": [90.0, 110.0],
            "images_per_cpu_s_range": [45.0, 55.0],
        }
        for name in (bench.LIMIT, bench.HPCTRAIN)
    }
    meta = {
        "images": 8,
        "workers": 2,
        "batch_size": 8,
        "rounds": 1,
        "crop": 32,
        "load_average": 0.5,
        "skipped": skipped,
    }
    lines = bench.format_report(meta, summary, {}).splitlines()
    assert (
        f"{peers.STREAMING}: skipped, streaming is not installed (import of streaming halted; "
        f"None in sys.modules); {install_hint('bench')}"
    ) in lines


def test_report_lines_name_both_sides_and_the_unit():
    """Every ratio line reads `A / B (unit): x.xx`; case lines carry both rates."""
    names = [bench.LIMIT, bench.STEADY, peers.LITDATA, peers.STREAMING]
    names += [bench.SEGMENTATION_LIMIT, bench.SEGMENTATION]
    names += [bench.side_by_side_name(2), bench.HPCTRAIN, bench.IMAGE_FOLDER, bench.WEBDATASET]
    summary = {
        name: {
            "images_per_s": 200.0 + i,
            "images_per_cpu_s": 100.0 + i,
            "images_per_s_range": [190.0, 210.0 + i],
            "images_per_cpu_s_range": [95.0, 105.0 + i],
        }
        for i, name in enumerate(names)
    }
    comparisons = bench.ratios(summary, 2, None)
    assert comparisons["hpctrain steady state / LitData steady state (images per CPU-s)"] == (
        pytest.approx(101 / 102)
    )
    assert comparisons[
        "hpctrain steady state / MosaicML Streaming steady state (images per CPU-s)"
    ] == pytest.approx(101 / 103)
    assert comparisons[
        "hpctrain segmentation steady state / segmentation limit (images per CPU-s)"
    ] == pytest.approx(105 / 104)
    meta = {"images": 8, "workers": 2, "batch_size": 8, "rounds": 3, "crop": 32}
    meta["load_average"] = 1.0
    lines = bench.format_report(meta, summary, comparisons).splitlines()
    ratio_line = re.compile(
        r"^(?P<a>[^/]+) / (?P<b>.+) \((images per CPU-s|images per wall second)\): \d+\.\d\d$"
    )
    ratio_lines = [line for line in lines if ratio_line.match(line)]
    assert len(ratio_lines) == len(comparisons)
    for name in names:
        case_line = next(line for line in lines if line.startswith(name))
        assert re.search(r"\d+ \(\d+-\d+\) +\d+ \(\d+-\d+\)$", case_line), case_line
    assert "images/s (range)" in lines[1] and "images/CPU-s (range)" in lines[1]


def test_segmentation_cases_batch_image_and_mask(setup):
    """The segmentation case's batches hold the crop of the image and of its mask, class ids
    kept (nearest-neighbour resize of a palette mask), and its limit decodes both."""
    assert bench.segmentation_limit(setup) == setup.num_images
    loader = bench._sharded_loader(
        setup, setup.segmentation_index, setup.data, SegmentationTransform(setup.crop)
    )
    batches = list(loader)
    assert sum(len(b["image"]) for b in batches) == setup.num_images
    for batch in batches:
        assert batch["image"].shape == (8, 3, 32, 32) and batch["image"].dtype == torch.uint8
        assert batch["mask"].shape == (8, 32, 32) and batch["mask"].dtype == torch.uint8
        assert int(batch["mask"].max()) < 21  # class ids, not colours
    count, wall, cpu = bench.hpctrain_steady(
        setup, setup.segmentation_index, SegmentationTransform(setup.crop)
    )
    assert count == setup.num_images and wall > 0 and cpu > 0


@pytest.mark.parametrize("peer", peers.PEERS, ids=lambda peer: peer.module)
def test_peer_case_reads_every_image(setup, peer):
    """With the `bench` extra installed the peer's case runs; without it (CI) the bench
    reports it skipped. No pytest skip: in CI a skipped test counts as failed."""
    missing = peers.missing_peers()
    if peer.name in missing:
        assert not _importable(peer.module)
        assert missing[peer.name].startswith(f"{peer.module} is not installed (")
        return
    path = peers.convert_for_peer(setup, peer)
    count, wall, cpu = peer.read(setup, path)
    assert count == setup.num_images and wall > 0 and cpu > 0


def test_unknown_case_group_is_a_usage_error(capsys):
    assert main(["bench", "loader", "--cases", "hpctrain,lidata"]) == UsageError.exit_code
    err = capsys.readouterr().err
    assert "--cases 'hpctrain,lidata': unknown group(s) lidata; choose from limit," in err


def test_cases_choose_the_groups_run(capsys, no_peers):
    args = ["bench", "loader", "--images", "8", "--rounds", "1", "--workers", "1"]
    assert main([*args, "--batch-size", "8", "--crop", "32", "--cases", "limit,peers"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split("  ")[0] for line in lines[2:4]] == [
        bench.LIMIT,
        "limit x1, forked, side by side",
    ]
    assert f"{peers.LITDATA}: skipped, litdata is not installed" in "\n".join(lines)
    assert not any(line.startswith("hpctrain") for line in lines)
