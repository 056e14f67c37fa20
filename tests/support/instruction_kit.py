"""Instruction data for the loss-mask tests: prompts of random letters, one fixed response.

No byte of the response (or the EOD, 256) occurs in a prompt, so the bytes tokenizer's mask
is known from the ids alone (`expected_mask`): the targets are the response's bytes and the
EOD.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

PROMPT_LETTERS = "abcdefghij"
RESPONSE = "ZZ TOP."
EOD = 256


def write_instructions(path: Path, num: int, seed: int = 0) -> list[dict[str, str]]:
    """`num` JSONL records {"prompt": 4-12 random letters + newline, "response": RESPONSE}."""
    rng = random.Random(seed)
    rows = [
        {
            "prompt": "".join(rng.choice(PROMPT_LETTERS) for _ in range(rng.randint(4, 12))) + "\n",
            "response": RESPONSE,
        }
        for _ in range(num)
    ]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return rows


def expected_mask(ids: np.ndarray) -> np.ndarray:
    """The targets of byte ids of these records: the response's bytes and the EOD."""
    response = np.frombuffer(RESPONSE.encode(), dtype=np.uint8).astype(np.int64)
    return np.isin(ids, np.append(response, EOD))
