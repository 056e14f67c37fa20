"""Answers and their scores (`hpctrain.tasks.answers`): normalisation, token F1, which part of
an instruction document is the prompt and which the reference, documents read whole."""

from __future__ import annotations

import io
import re
import string
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch

from hpctrain.data.documents import Document, iter_documents
from hpctrain.data.index import ShardIndex, ShardInfo, index_to_bytes
from hpctrain.data.tokens import encode_loss_mask, encode_tokens
from hpctrain.tasks.answers import (
    Example,
    Share,
    answer_examples,
    answer_metrics,
    answer_sums,
    example_of,
    normalize,
    token_f1,
)

EOD, TURN_END = 256, 257


def test_normalisation_steps_and_token_f1() -> None:
    text = "  The  Cat,\n sat. "
    assert normalize(text, ("whitespace", "case")) == "the cat, sat."
    assert normalize(text, ("whitespace", "case", "punctuation", "articles")) == "cat sat"
    assert normalize(text, ()) == text
    assert token_f1("cat sat", "cat sat") == 1.0
    assert token_f1("the cat", "cat sat down") == pytest.approx(2 * 0.5 * (1 / 3) / (0.5 + 1 / 3))
    assert token_f1("", "") == 1.0 and token_f1("cat", "") == 0.0 and token_f1("a", "b") == 0.0


def squad_normalized(text: str) -> str:
    """SQuAD v1.1's published `normalize_answer` (evaluate-v1.1.py), restated: lower case,
    ASCII punctuation deleted, the articles a/an/the replaced by a space, whitespace fixed."""
    text = "".join(c for c in text.lower() if c not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


SQUAD = ("whitespace", "case", "punctuation", "articles")


@pytest.mark.parametrize(
    ("answer", "reference"),
    [
        ("U.S.", "US"),
        ("3,000", "3000"),
        ("don't", "dont"),
        ("The  Eiffel\tTower!", "eiffel tower"),
        ("an apple, a pear", "apple pear"),
        ("theatre", "theatre"),  # an article inside a word stays
        ("  A\n", ""),
        ("e.g. (x-ray)", "eg xray"),
        ("café – naïve", "café – naïve"),  # not ASCII punctuation: SQuAD keeps it
    ],
)
def test_squad_options_normalise_as_squads_scorer(answer: str, reference: str) -> None:
    assert normalize(answer, SQUAD) == squad_normalized(answer) == squad_normalized(reference)
    assert normalize(reference, SQUAD) == squad_normalized(reference)
    assert token_f1(normalize(answer, SQUAD), normalize(reference, SQUAD)) == 1.0


def doc(ids: list[int], targets: list[int]) -> Document:
    mask = np.zeros(len(ids), dtype=bool)
    mask[targets] = True
    return Document("d", np.array(ids), mask)


def test_the_last_target_run_is_the_reference_up_to_its_first_stop() -> None:
    # prompt/response: prompt 1 2 3, response 4 5, EOD
    example = example_of(doc([1, 2, 3, 4, 5, EOD], [3, 4, 5]), EOD, {EOD})
    assert example == Example("d", (1, 2, 3), (4, 5), frozenset({EOD}))
    # a chat: user 1 2, assistant 3 <end> 9, user 6, assistant 7 8 <end>, EOD (targets)
    ids = [1, 2, 3, TURN_END, 9, 6, 7, 8, TURN_END, EOD]
    example = example_of(doc(ids, [2, 3, 6, 7, 8, 9]), EOD, {EOD, TURN_END})
    assert example is not None and example.prompt == (1, 2, 3, TURN_END, 9, 6)
    assert example.reference == (7, 8) and example.stops == {EOD, TURN_END}
    # nothing to answer: no targets, no mask, or targets from the first token
    assert example_of(doc([1, 2, EOD], []), EOD, set()) is None
    assert example_of(Document("d", np.array([1, EOD]), None), EOD, set()) is None
    assert example_of(doc([4, 5, EOD], [0, 1, 2]), EOD, set()) is None


def test_documents_come_whole_with_their_masks(tmp_path: Path) -> None:
    samples = [([1, 2, EOD, 3, EOD], [0, 1, 1, 0, 1]), ([4, 5, 6, EOD], [0, 0, 1, 1])]
    with tarfile.open(tmp_path / "s.tar", "w", format=tarfile.USTAR_FORMAT) as tar:
        for n, (ids, mask) in enumerate(samples):
            for name, data in (
                (f"{n}.loss_mask.bits", encode_loss_mask(mask)),
                (f"{n}.tokens.u16", encode_tokens(ids, "tokens.u16")),
            ):
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    size = (tmp_path / "s.tar").stat().st_size
    tokenizer = {"name": "bytes", "vocab_size": 257, "eod_id": EOD, "sha256": ""}
    index = ShardIndex(shards=(ShardInfo("s.tar", 2, size, num_tokens=9),), tokenizer=tokenizer)
    (tmp_path / "index.json").write_bytes(index_to_bytes(index))
    from hpctrain.data import open_index

    docs = list(iter_documents(open_index(str(tmp_path / "index.json"))))
    assert [d.ids.tolist() for d in docs] == [[1, 2, EOD], [3, EOD], [4, 5, 6, EOD]]
    assert [d.key for d in docs] == ["s.tar:0#0", "s.tar:0#1", "s.tar:1#0"]
    assert docs[2].mask is not None and docs[2].mask.tolist() == [False, False, True, True]


class EchoModel(torch.nn.Module):
    """Stands in for a GPT in the share arithmetic: always answers id `answer` (7)."""

    def __init__(self, answer: int = 7, vocab: int = 9) -> None:
        super().__init__()
        self.answer, self.vocab = answer, vocab
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.blocks = torch.nn.ModuleList([torch.nn.Module()])
        self.blocks[0].attention = torch.nn.Module()  # type: ignore[assignment]
        self.blocks[0].attention.wq = torch.nn.Linear(1, 1)  # type: ignore[union-attr]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, cache: object) -> torch.Tensor:
        cache.advance()  # type: ignore[attr-defined]
        logits = torch.zeros(*tokens.shape, self.vocab)
        logits[..., self.answer] = 1
        return logits


class Letters:
    def decode(self, ids: list[int], unknown: str | None = None) -> str:
        return "".join(chr(ord("a") + i) for i in ids)


def test_each_rank_answers_its_share_and_the_counts_add_up() -> None:
    examples = [Example(str(n), (1, 2), (7,) if n % 2 else (6,), frozenset({8})) for n in range(5)]
    shares = [
        answer_examples(
            EchoModel(),
            examples,
            Letters(),
            max_new_tokens=1,
            batch_size=2,  # type: ignore[arg-type]
            share=Share(rank, 2),
        )
        for rank in range(2)
    ]
    assert [[a.example.key for a in share] for share in shares] == [["0", "2", "4"], ["1", "3"]]
    total = {
        k: sum(answer_sums(s, torch.device("cpu"))[k] for s in shares)
        for k in ("answers", "answers_exact", "answers_f1")
    }
    assert answer_metrics(total) == {"exact_match": 0.4, "token_f1": 0.4, "answers": 5.0}


def test_an_id_past_the_tokenizers_vocabulary_scores_as_a_wrong_answer() -> None:
    """A model's vocabulary may be padded past its tokenizer's (Qwen2: 151,936 rows for
    151,665 tokens); a generated id there has no text. It used to end the run at its final
    evaluation (`token ids must lie in [0, 257)`)."""
    from hpctrain.data.tokenizer import UNKNOWN, load_tokenizer

    tokenizer = load_tokenizer("bytes")  # ids 0-255 and EOD 256
    example = Example("d", tuple(b"Q: "), tuple(b"A"), frozenset({EOD}))
    (answer,) = answer_examples(
        EchoModel(answer=300, vocab=320),
        [example],
        tokenizer,
        max_new_tokens=2,
        batch_size=1,
        share=Share(0, 1),
    )
    assert answer.answer == UNKNOWN * 2 and answer.reference == "A"
    assert not answer.exact_match and answer.token_f1 == 0.0
    assert tokenizer.decode([65, 300, 66], unknown="?") == "A?B"
    with pytest.raises(ValueError, match=r"token ids must lie in \[0, 257\)"):
        tokenizer.decode([65, 300])  # where ids come from data, still an error
