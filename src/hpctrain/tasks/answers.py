"""Answers scored: a language model's greedy answer to each prompt against its reference.

Instruction data (`hpctrain.convert.instructions`) marks the tokens a model learns to write:
a document's last run of targets is the answer to everything before it, its prompt. For a
prompt/response record that is the response and the end-of-document id; for a chat, the last
assistant turn (the text after its header, through the end-of-turn token). `example_of`
cuts a document so: the reference is the run up to its first stop id, the stop ids being the
end-of-document id and the first special token of the run (the end-of-turn token of a chat
template, `<|im_end|>`, `<|eot_id|>`), where the model learnt to stop.

`answer_examples` decodes the prompts greedily (`hpctrain.models.decoding`) in batches, cuts
each answer at its first stop id, and compares the texts: `exact_match` after normalisation
(`eval.normalize`: whitespace runs collapsed and the ends stripped, lower case; optionally
ASCII punctuation deleted and the English articles a/an/the removed, in SQuAD's scorer's order
and manner: `U.S.` is `us`, `3,000` is `3000`) and `token_f1`, the F1
of the normalised texts' words (multiset overlap). Several ranks each answer their share
(`Share`): example i belongs to data-parallel rank i mod size, and every rank runs the same
number of batches so that sharded models decode in lockstep; `answer_sums` gives the counts
to add over ranks.
"""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from hpctrain.data.documents import Document
from hpctrain.data.tokenizer import UNKNOWN, Tokenizer
from hpctrain.models.decoding import decode

NORMALIZATIONS = ("whitespace", "case", "punctuation", "articles")
ARTICLES = re.compile(r"\b(a|an|the)\b")
# SQuAD's scorer deletes `string.punctuation` (ASCII) and keeps other characters as they are
PUNCTUATION = str.maketrans("", "", string.punctuation)
METRICS = ("exact_match", "token_f1")  # val_<name> in eval records (with eval.generate)


def normalize(text: str, options: Collection[str]) -> str:
    """`text` after the steps of `options` (see the module), in a fixed order."""
    if "case" in options:
        text = text.lower()
    if "punctuation" in options:  # deleted, not spaced: SQuAD's `remove_punc`
        text = text.translate(PUNCTUATION)
    if "articles" in options:
        text = ARTICLES.sub(" ", text)
    if "whitespace" in options:
        text = " ".join(text.split())
    return text


def token_f1(answer: str, reference: str) -> float:
    """F1 of the words of two (normalised) texts; 1 when both have none."""
    ours, theirs = answer.split(), reference.split()
    if not ours or not theirs:
        return float(ours == theirs)
    common = sum((Counter(ours) & Counter(theirs)).values())
    if not common:
        return 0.0
    precision, recall = common / len(ours), common / len(theirs)
    return 2 * precision * recall / (precision + recall)


@dataclass(frozen=True)
class Example:
    """A prompt and its reference answer (ids, the stop id left out), and where it came from."""

    key: str
    prompt: tuple[int, ...]
    reference: tuple[int, ...]
    stops: frozenset[int]


def example_of(document: Document, eod_id: int, special_ids: Collection[int]) -> Example | None:
    """The example of an instruction `document` (see the module); None when it has no
    targets, or none after a prompt."""
    if document.mask is None or not document.mask.any():
        return None
    targets = np.flatnonzero(document.mask)
    gaps = np.flatnonzero(np.diff(targets) > 1)
    start = int(targets[gaps[-1] + 1] if gaps.size else targets[0])
    end = int(targets[-1]) + 1
    if start == 0:
        return None  # nothing to answer
    run = [int(i) for i in document.ids[start:end]]
    stops = {eod_id}
    turn_end = next((i for i in run if i in special_ids and i != eod_id), None)
    if turn_end is not None:
        stops.add(turn_end)
    cut = next((n for n, i in enumerate(run) if i in stops), len(run))
    prompt = tuple(int(i) for i in document.ids[:start])
    return Example(document.key, prompt, tuple(run[:cut]), frozenset(stops))


@dataclass(frozen=True)
class Share:
    """Which examples this rank answers: those with index ≡ `rank` mod `size`;
    `lockstep`: ranks that must run every forward together (sharded or split models)."""

    rank: int = 0
    size: int = 1
    lockstep: bool = False


@dataclass(frozen=True)
class Answer:
    """One example answered: the texts and the scores."""

    example: Example
    prompt: str
    reference: str
    answer: str
    exact_match: bool
    token_f1: float


def answer_examples(
    model: nn.Module,
    examples: Sequence[Example],
    tokenizer: Tokenizer,
    *,
    max_new_tokens: int,
    batch_size: int,
    window: int = 0,
    normalize_with: Collection[str] = ("whitespace", "case"),
    share: Share = Share(),
) -> list[Answer]:
    """This rank's share of `examples`, answered greedily and scored (see the module).

    Every rank runs ceil(ceil(len / size) / batch_size) batches, padding its last ones with
    a one-token prompt whose answer is dropped, whatever its share.
    """
    mine = list(examples[share.rank :: share.size])
    per_rank = math.ceil(len(examples) / share.size)
    num_batches = math.ceil(per_rank / batch_size) if per_rank else 0
    stops = sorted({stop for example in examples for stop in example.stops})
    filler = (stops[0] if stops else 0,)
    answers: list[Answer] = []
    for b in range(num_batches):
        batch = mine[b * batch_size : (b + 1) * batch_size]
        prompts = [e.prompt for e in batch] or [filler]
        continued = decode(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            stop_ids=stops,
            window=window,
            lockstep=share.lockstep,
        )
        for example, ids in zip(batch, continued, strict=False):
            cut = next((n for n, i in enumerate(ids) if i in example.stops), len(ids))
            answers.append(score(example, ids[:cut], tokenizer, normalize_with))
    return answers


def score(
    example: Example, ids: Sequence[int], tokenizer: Tokenizer, options: Collection[str]
) -> Answer:
    """`example` answered with `ids`, its texts compared."""
    answer = tokenizer.decode(list(ids), unknown=UNKNOWN)  # generated: may lie past it
    reference = tokenizer.decode(list(example.reference))
    ours, theirs = normalize(answer, options), normalize(reference, options)
    return Answer(
        example=example,
        prompt=tokenizer.decode(list(example.prompt)),
        reference=reference,
        answer=answer,
        exact_match=ours == theirs,
        token_f1=token_f1(ours, theirs),
    )


def answer_sums(answers: Sequence[Answer], device: torch.device) -> dict[str, torch.Tensor]:
    """The counts to add over ranks: answers, exact matches, the sum of token F1s."""
    return {
        "answers": torch.tensor(float(len(answers)), device=device, dtype=torch.float64),
        "answers_exact": torch.tensor(
            float(sum(a.exact_match for a in answers)), device=device, dtype=torch.float64
        ),
        "answers_f1": torch.tensor(
            float(sum(a.token_f1 for a in answers)), device=device, dtype=torch.float64
        ),
    }


def answer_metrics(sums: dict[str, torch.Tensor]) -> dict[str, float]:
    """exact_match and token_f1 (fractions of the answers) and the number of answers."""
    count = float(sums["answers"])
    return {
        "exact_match": float(sums["answers_exact"]) / max(1.0, count),
        "token_f1": float(sums["answers_f1"]) / max(1.0, count),
        "answers": count,
    }
