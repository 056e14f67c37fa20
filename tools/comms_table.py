"""Write the strategy table of docs/training.md from `hpctrain.parallel.comms` (`make docs`).

The rows: the GPT presets from 1B up (vocabulary 128,256, Llama 3's) on 4 nodes of 4 GPUs
(Jean Zay's H100 nodes) and 2 nodes of 8 (its A100 nodes). `--check` exits 1 when the page's
table is stale, without writing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpctrain.models.gpt import gpt_config, num_params
from hpctrain.parallel.comms import markdown_table

PAGE = Path(__file__).resolve().parents[1] / "docs" / "training.md"
BEGIN = "<!-- comms-table: begin (tools/comms_table.py) -->\n"
END = "<!-- comms-table: end -->\n"
PRESETS = ("gpt-1b", "gpt-3b", "gpt-8b")
LAYOUTS = [(4, 4), (2, 8)]
VOCAB = 128_256


def render(page: str) -> str:
    models = {}
    for name in PRESETS:
        cfg = gpt_config(name, VOCAB)
        models[name] = (num_params(cfg), cfg.n_layers + 1)
    table = markdown_table(models, LAYOUTS)
    head, found, rest = page.partition(BEGIN)
    if not found or END not in rest:
        raise SystemExit(f"{PAGE}: no {BEGIN.strip()} ... {END.strip()} markers")
    return head + BEGIN + table + "\n" + END + rest.partition(END)[2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the table is stale")
    args = parser.parse_args(argv)
    page = PAGE.read_text(encoding="utf-8")
    text = render(page)
    if args.check:
        return 0 if text == page else 1
    PAGE.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
