"""Write docs/config-reference.md: every config key, its default and meaning (`make docs`).

The page is generated from the schema's `help` texts (`hpctrain.config.load.reference_rows`);
run this after changing the schema. A test keeps the page current; `--check` exits 1 when
it is stale, without writing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hpctrain.config.load import reference_rows

PAGE = Path(__file__).resolve().parents[1] / "docs" / "config-reference.md"
HEADER = """\
# Config reference

Every key of a config file, its default and what it means, generated from
`src/hpctrain/config/schema.py` by `make docs` (`tools/config_reference.py`): do not edit this
page, edit the schema's `help` texts. How configs are read and overridden:
[configuration.md](configuration.md).

"""


def render() -> str:
    """The whole page, as `make docs` writes it."""
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, help_text in reference_rows():
        lines.append(f"| `{key}` | `{default}` | {help_text.replace('|', '&#124;')} |")
    return HEADER + "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = PAGE.read_text(encoding="utf-8") if PAGE.exists() else ""
        if current != text:
            print(f"{PAGE} is stale: run make docs", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text, encoding="utf-8")
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
