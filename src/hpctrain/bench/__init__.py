"""Benchmarks behind `hpctrain bench <case>` and `tools/gpu_bench.sh`, one module per part measured.

They ship with the package because compute nodes run the installed package. Each measures its
part side by side with a baseline in one run and prints ratios; they use only the public API
of what they measure.

- `loader` (its inputs in `loader_setup`, the peers in `loader_peers`): the loader against the
  decode limit, ImageFolder, webdataset, LitData and MosaicML Streaming (the `bench` extra),
  and segmentation batches against their own limit;
- `convert`: shard writers (tarfile, webdataset.ShardWriter, `hpctrain convert`);
- `checkpoint`: saves and loads against `dd`, DCP and `torch.save`;
- `trainer`: the Trainer's step against a hand-written loop;
- `gpu_vision`: the Python half of `tools/gpu_bench.sh` (ResNet-50, the precision matrix's GPU
  cells); `gpu_lm`: `hpctrain bench gpu-lm` (or `gpu`), the LLM case; `gpu_report`: the
  report both print;
- `probe`: the health probe's gather of many peers (resilience/probe.py), serial vs concurrent;
- `loopback`: an HTTP server on 127.0.0.1 (the loader's remote cases, the remote-storage tests);
- `measure`: CPU-time accounting shared by the benchmarks.
- `quick`: `make bench-quick`, the goals these benches check, one line each (`goal | ratio |
  met/missed/noisy`), at sizes of a few minutes on a development machine.
"""
