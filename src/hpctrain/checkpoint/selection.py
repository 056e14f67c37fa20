"""Which checkpoint a load picks, and the steps it sets aside.

Which checkpoint `load("latest")` picks, by step numbers and the pointer only (never by the
times in manifests: node clocks differ):

1. `latest` names the newest committed step of the current run. Each manifest names its
   `parent`: the step the saving run had loaded or saved before it (null for a run's first
   save). The one step past the pointer whose parent is the pointer's step is the current
   run's too (a commit cut between its rename and the pointer: a SIGKILL at the end of a
   preemption save must not lose that save): it is tried first. Other steps above the
   pointer (a run started over with `--resume none` over older, higher steps) are never
   loaded, and set aside as `.abandoned-step-<N>` when the run resumes below them (as for a
   rollback with `--resume PATH`, which sets aside everything past the resumed step).
2. Then the step the pointer names, if it verifies; else the highest step below it that
   verifies. Each one that fails is set aside as `.damaged-step-<N>` with the reason logged.
3. Without a readable pointer (a first save cut before it), the highest step that verifies.

Everything here runs on rank 0; the manager broadcasts the choice.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from hpctrain.checkpoint.manifest import (
    ABANDONED_PREFIX,
    BEST_NAME,
    DAMAGED_PREFIX,
    LATEST_NAME,
    MANIFEST_NAME,
    committed_steps,
    parse_manifest,
    read_latest,
    step_dir_name,
    verify_checkpoint,
)
from hpctrain.checkpoint.safety import CheckpointError, UnsafeCheckpointError
from hpctrain.checkpoint.storage import Store, open_store

log = logging.getLogger(__name__)

# (root, folder name, manifest) of the checkpoint to load
Choice = tuple[str, str, dict[str, Any]]


def _parent_of(store: Store, step: int) -> int | None:
    """The `parent` that step `step`'s manifest names; None when it names none or is
    unreadable (verification then says why, if the step is ever tried)."""
    name = step_dir_name(step)
    try:
        manifest = parse_manifest(store.read_bytes(f"{name}/{MANIFEST_NAME}"), name, name)
    except (OSError, CheckpointError):
        return None
    parent = manifest.get("parent")
    return parent if isinstance(parent, int) else None


def steps_to_try(
    steps: list[int], pointer: int | None, parent_of: Callable[[int], int | None] = lambda s: None
) -> tuple[list[int], list[int]]:
    """(steps to try in this order, steps past the pointer that are never loaded): the rule
    of the module docstring, from the committed steps, `latest`'s step and the `parent` that
    a step's manifest names (None when unreadable)."""
    if pointer is None:
        return sorted(steps, reverse=True), []
    below = sorted((s for s in steps if s <= pointer), reverse=True)
    past = sorted(s for s in steps if s > pointer)
    if past and parent_of(past[0]) == pointer:  # the next commit, cut before the pointer
        return [past[0], *below], past[1:]
    return below, past


def choose(own: Store, which: str, verify: str, skip: set[str]) -> Choice | None:
    """The checkpoint to load for `which` ("latest" of the run's root `own`, a `step-<N>`
    folder or another root), or None; damaged steps of `own` are set aside."""
    if which != "latest":
        parent, _, leaf = which.rstrip("/").rpartition("/")
        store = open_store(parent or ".")
        if store.exists(f"{leaf}/{MANIFEST_NAME}"):
            return store.root, leaf, verify_checkpoint(store, leaf, verify)
        root_store = open_store(which)
        if not committed_steps(root_store):
            raise CheckpointError(f"{which}: neither a checkpoint nor a folder of checkpoints")
        return _choose_newest(own, root_store, verify, skip)
    return _choose_newest(own, own, verify, skip)


def _choose_newest(own: Store, store: Store, verify: str, skip: set[str]) -> Choice | None:
    """The checkpoint of `store` that the rule of the module docstring picks."""
    steps = committed_steps(store)
    if not steps:
        return None
    pointer = read_latest(store)
    candidates, past = steps_to_try(steps, pointer, lambda s: _parent_of(store, s))
    if past:
        log.warning(
            "%s names step-%d: %s past it are not the current run's and are not loaded",
            store.path(LATEST_NAME),
            pointer,
            ", ".join(step_dir_name(s) for s in past),
        )
    problems, damaged = [], []
    for step in candidates:
        name = step_dir_name(step)
        if store.path(name) in skip:
            continue
        try:
            manifest = verify_checkpoint(store, name, verify)
        except UnsafeCheckpointError:
            raise
        except CheckpointError as exc:
            log.warning("checkpoint %s is damaged, trying an older one: %s", name, exc)
            problems.append(str(exc))
            damaged.append(step)
            continue
        if problems:
            log.warning("falling back to %s (%d newer damaged)", store.path(name), len(problems))
        if store.root == own.root:
            set_aside(own, damaged, DAMAGED_PREFIX, "damaged")
        return store.root, name, manifest
    if store.root == own.root:
        set_aside(own, damaged, DAMAGED_PREFIX, "damaged")
    found = (
        "; ".join(problems) or f"{LATEST_NAME} names step-{pointer}, and no step is at or below it"
    )
    raise CheckpointError(
        f"{store.root}: no loadable checkpoint ({found}); "
        "use --resume none to start over or --resume PATH"
    )


def set_aside(store: Store, steps: list[int], prefix: str, why: str) -> None:
    """Rename `step-<N>` folders to `<prefix><N>`: kept for inspection, never loaded, never
    removed by retention."""
    for step in steps:
        target = f"{prefix}{step}"
        suffix = 1
        while store.exists(target):
            target, suffix = f"{prefix}{step}.{suffix}", suffix + 1
        store.rename_dir(step_dir_name(step), target)
        log.warning("set aside %s (%s) as %s", step_dir_name(step), why, store.path(target))


def set_aside_newer(own: Store, choice: Choice) -> list[int]:
    """Set aside the steps of `own` at or past the step being resumed, other than itself;
    return them.

    Training redoes those steps. Left in place, a damaged or abandoned `step-<N>` would
    turn the next save of step N into a no-op, make `latest_step()` name it, and come
    back on the next automatic resume.
    """
    root, name, manifest = choice
    step = int(manifest["step"])
    chosen = open_store(root).path(name)
    newer = [
        s
        for s in committed_steps(own)
        if s > step or (s == step and own.path(step_dir_name(s)) != chosen)
    ]
    set_aside(own, newer, ABANDONED_PREFIX, f"newer than the resumed step {step}")
    return newer


def set_aside_all(own: Store) -> bool:
    """`--resume none`: set aside every committed step of the root (an earlier run's), so
    that this run's steps and `latest` are its own only; False when there was none.

    Left in place, an old `step-<N>` would turn this run's save of step N into a no-op,
    and `latest` would bring the old run back on the next automatic resume. The pointers
    are removed: the folders they name are set aside, kept under their new names.
    """
    steps = committed_steps(own)
    if not steps:
        return False
    set_aside(own, steps, ABANDONED_PREFIX, "an earlier run's: --resume none starts over")
    for pointer in (LATEST_NAME, BEST_NAME):
        if own.exists(pointer):
            own.rmtree(pointer)
    return True


def peek(own: Store, which: str) -> dict[str, Any] | None:
    """The manifest of the checkpoint `load(which)` would pick, read on this process without
    verifying the files or setting anything aside; None when there is none ("none", an empty
    root, no readable manifest): what a run needs to know before it builds its model, such
    as the model's shape and tokenizer it records.

    A newest step that turns out damaged makes the load fall back to an older one of the same
    run, which records the same model.
    """
    if which == "none":
        return None
    try:
        store = own
        if which != "latest":
            parent, _, leaf = which.rstrip("/").rpartition("/")
            parent_store = open_store(parent or ".")
            if parent_store.exists(f"{leaf}/{MANIFEST_NAME}"):
                data = parent_store.read_bytes(f"{leaf}/{MANIFEST_NAME}")
                return parse_manifest(data, parent_store.path(leaf), leaf)
            store = open_store(which)
        steps = committed_steps(store)
        candidates, _ = steps_to_try(steps, read_latest(store), lambda s: _parent_of(store, s))
        for step in candidates:
            name = step_dir_name(step)
            try:
                return parse_manifest(store.read_bytes(f"{name}/{MANIFEST_NAME}"), name, name)
            except (OSError, CheckpointError):
                continue  # the load will say why, or fall back past it too
    except (OSError, CheckpointError):
        return None
    return None
