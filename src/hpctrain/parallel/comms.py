"""What each data-parallel strategy sends over the network, per optimizer step: a model to
choose `train.strategy` before a job is queued (the table in docs/training.md is made from it).

The model: ring collectives (NCCL's default for large messages), ranks numbered node by node
(as SLURM and torchrun do), bf16 parameters gathered for compute, fp32 gradients reduced (as
hpctrain's FSDP2 policy does), `train.reshard_after_forward: true` (parameters gathered again
for the backward), one micro-batch per step. A ring collective over n ranks moves
(n - 1) / n of the message across each of its links (an all-reduce twice that); a node's
traffic onto the network is what leaves it on the ring links that cross a node boundary.

- DDP: one all-reduce of the fp32 gradients over all W ranks, in buckets that overlap the
  backward.
- FSDP2 (flat): per block, an all-gather of its bf16 parameters in the forward and again in
  the backward, and a reduce-scatter of its fp32 gradients, all over the W ranks: three
  collectives per block that cross nodes, and the forward's gathers sit on the critical path.
- HSDP: the same all-gathers and reduce-scatters inside each shard group (a node's ranks:
  its NVLink), then an all-reduce of each rank's gradient shard with its replicas on the
  other nodes: one collective per block crosses nodes, and it overlaps the backward.

The bytes per node come out close for the three (about 8 bytes per parameter): what HSDP
saves is the number and latency of the collectives that cross nodes, and the parameter
gathers that the forward waits for; what FSDP2 and HSDP save over DDP is memory.
"""

from __future__ import annotations

from dataclasses import dataclass

PARAM_BYTES = 2  # bf16 parameters gathered for compute
GRAD_BYTES = 4  # fp32 gradient reduction
STATE_BYTES = 16  # per parameter: fp32 master weight, gradient and AdamW's two moments
DDP_BUCKET_BYTES = 25 * 2**20  # DDP's default bucket_cap_mb


@dataclass(frozen=True)
class Traffic:
    """One strategy's cost on one layout, per optimizer step."""

    network_bytes_per_node: float  # sent onto the inter-node network by each node
    cross_node_collectives: int  # collectives whose ring crosses nodes
    state_bytes_per_gpu: float  # parameters, gradients and optimizer state held by each GPU


def traffic(
    strategy: str,
    params: int,
    units: int,
    nodes: int,
    gpus_per_node: int,
    shard_degree: int = 0,
) -> Traffic:
    """The cost of `strategy` (ddp, fsdp or hsdp) for a model of `params` parameters in
    `units` FSDP units (blocks + the root) on `nodes` x `gpus_per_node` ranks.

    `shard_degree` (hsdp): ranks per shard group, 0 for a node's; a group larger than a node
    also gathers across nodes.
    """
    world = nodes * gpus_per_node
    if strategy == "ddp":
        buckets = -(-params * GRAD_BYTES // DDP_BUCKET_BYTES)
        ring = 2 * (world - 1) / world * params * GRAD_BYTES if nodes > 1 else 0.0
        return Traffic(ring, buckets if nodes > 1 else 0, STATE_BYTES * params)
    gathered = 2 * params * PARAM_BYTES + params * GRAD_BYTES  # two all-gathers, one reduce-scatter
    if strategy == "fsdp":
        ring = (world - 1) / world * gathered if nodes > 1 else 0.0
        return Traffic(ring, 3 * units if nodes > 1 else 0, STATE_BYTES * params / world)
    if strategy != "hsdp":
        raise ValueError(f"strategy {strategy!r}: expected ddp, fsdp or hsdp")
    shard = shard_degree or gpus_per_node
    if world % shard:
        raise ValueError(f"shard degree {shard} does not divide {world} ranks")
    replicas = world // shard
    # each of a node's ranks all-reduces its 1/shard of the gradients with its replicas
    ranks_per_node_in_group = min(shard, gpus_per_node)
    reduce = 2 * (replicas - 1) / replicas * params * GRAD_BYTES / shard * ranks_per_node_in_group
    inside = 0.0
    collectives = units if replicas > 1 else 0
    if shard > gpus_per_node:  # shard groups span nodes: their gathers cross too
        inside = (shard - 1) / shard * gathered
        collectives += 3 * units
    return Traffic(reduce + inside, collectives, STATE_BYTES * params / shard)


def markdown_table(models: dict[str, tuple[int, int]], layouts: list[tuple[int, int]]) -> str:
    """Rows of (model, layout, strategy): GB per node per step, cross-node collectives per
    step, GiB of training state per GPU. `models`: name -> (parameters, FSDP units)."""
    lines = [
        "| model | params | nodes x GPUs | strategy | network GB / node / step | "
        "collectives crossing nodes / step | state GiB / GPU |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, (params, units) in models.items():
        for nodes, gpus in layouts:
            for strategy in ("ddp", "fsdp", "hsdp"):
                t = traffic(strategy, params, units, nodes, gpus)
                lines.append(
                    f"| {name} | {params / 1e9:.2f} B | {nodes} x {gpus} | {strategy} | "
                    f"{t.network_bytes_per_node / 1e9:.1f} | {t.cross_node_collectives} | "
                    f"{t.state_bytes_per_gpu / 2**30:.1f} |"
                )
    return "\n".join(lines)
