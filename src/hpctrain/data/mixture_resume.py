"""A mixture's loader state across runs: checking the saved sources, finding the origin again.

Same weights and epoch length: the saved origin holds (`with_state_origin`) and the epoch's
stages resume as planned. Weights changed between runs (`rebase`): the interrupted epoch ends
at the checkpoint and the next one starts a new plan (a new *origin*): each source's stream
then begins with the samples of the interrupted epoch it had not yet read, followed by the rest
of its old stream. Sources may be added after the saved ones (`check_state_sources`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from hpctrain.data.mixture import Mixture, MixtureError, SourceOrigin, plan_mixture
from hpctrain.data.planning import StageParams


def check_state_sources(mixture: Mixture, state: Mapping[str, Any]) -> list[str]:
    """The names of the sources `mixture` adds after those of a saved mixture state; refuse
    (naming the sources removed, changed or moved, and the way on) any other difference."""
    saved = [
        (name, int(shards), int(samples))
        for name, shards, samples in zip(
            state["names"], state["num_shards"], state["num_samples"], strict=True
        )
    ]
    # states saved before digests were kept have none: their counts alone are compared
    saved_digests = dict(zip(state["names"], state.get("digests") or [], strict=False))
    mine = [(s.name, len(s.shard_sizes), s.num_samples) for s in mixture.sources]
    replaced = [
        s.name
        for s in mixture.sources
        if saved_digests.get(s.name) and s.digest and saved_digests[s.name] != s.digest
    ]
    if mine[: len(saved)] == saved and not replaced:
        return [name for name, _, _ in mine[len(saved) :]]
    stats = {name: (shards, samples) for name, shards, samples in saved}
    mine_names = {name for name, _, _ in mine}
    changes = [f"removed {name}" for name in stats if name not in mine_names]
    changes += [f"added {name} before them" for name, _, _ in mine if name not in stats]
    changes += [
        f"changed {name} ({stats[name][0]} -> {shards} shards, "
        f"{stats[name][1]} -> {samples} samples)"
        if stats[name] != (shards, samples)
        else f"changed {name} (the same {shards} shards and {samples} samples, other contents)"
        for name, shards, samples in mine
        if name in stats and (stats[name] != (shards, samples) or name in replaced)
    ]
    if not changes:
        changes = [f"reordered (saved as {', '.join(stats)})"]
    raise MixtureError(
        f"the mixture's sources changed since the checkpoint: {'; '.join(changes)}. "
        f"A resume needs the saved sources ({', '.join(stats)}) unchanged and in that order; "
        "new sources may follow them (the next epoch then starts a new plan): "
        "set data.train back, or start over with --resume none"
    )


def with_state_origin(mixture: Mixture, state: Mapping[str, Any]) -> Mixture:
    """`mixture` with the origin a saved state recorded (same weights and epoch length)."""
    origins = tuple(
        SourceOrigin(
            tuple((int(a), int(b), int(c)) for a, b, c in o["leftover"]), int(o["position"])
        )
        for o in state["origins"]
    )
    return Mixture(
        mixture.sources,
        mixture.samples_per_epoch,
        origin_epoch=int(state["origin_epoch"]),
        origins=origins,
    )


def same_weights(mixture: Mixture, state: Mapping[str, Any]) -> bool:
    return [s.weight for s in mixture.sources] == [float(w) for w in state["weights"]] and (
        mixture.samples_per_epoch == int(state["samples_per_epoch"])
    )


def rebase(
    mixture: Mixture,
    new: Mixture,
    seed: int,
    epoch: int,
    stages: Sequence[StageParams],
    rotate_dropped: bool = True,
) -> Mixture:
    """`new` (other weights or epoch length, maybe sources added after the old ones)
    starting at epoch `epoch + 1`, each old source's stream continuing where `mixture` left it after `stages` of `epoch`: first the samples the
    interrupted epoch had not read, then the rest of its old stream."""
    last = plan_mixture(
        mixture,
        world_size=stages[-1].world_size,
        workers_per_rank=stages[-1].workers_per_rank,
        batch_size=stages[-1].batch_size,
        seed=seed,
        epoch=epoch,
        remainder=stages[-1].remainder,
        shuffle_buffer=stages[-1].shuffle_buffer,
        stages=stages[:-1],
        rotate_dropped=rotate_dropped,
    )
    left = last.remaining_sources(stages[-1].consumed)
    origins = []
    for s, q in enumerate(mixture.quotas()):
        end = (epoch - mixture.origin_epoch + 1) * q  # where the old stream's next epoch starts
        old = mixture.origin(s)
        rest = [
            (int(a), int(b), int(c))
            for a, b, c in zip(left[s].shard, left[s].start, left[s].end, strict=True)
        ]
        if end < old.num_leftover:
            seq = mixture.source_slice(s, seed, end, old.num_leftover)
            rest += [
                (int(a), int(b), int(c))
                for a, b, c in zip(seq.shard, seq.start, seq.end, strict=True)
            ]
        position = old.position + max(end - old.num_leftover, 0)
        origins.append(SourceOrigin(tuple(rest), position))
    # Sources `new` adds after the old ones start their streams at the new plan.
    origins += [SourceOrigin()] * (len(new.sources) - len(mixture.sources))
    return Mixture(
        new.sources, new.samples_per_epoch, origin_epoch=epoch + 1, origins=tuple(origins)
    )
