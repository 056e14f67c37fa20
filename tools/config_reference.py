"""Print the config reference (every key, its default and meaning) as a Markdown table.

The README embeds this output between the `config-reference` markers; a test keeps them equal:
    python tools/config_reference.py > /tmp/ref.md
"""

from __future__ import annotations

from hpctrain.config.load import reference_rows


def render() -> str:
    lines = ["| key | default | meaning |", "| --- | --- | --- |"]
    for key, default, help_text in reference_rows():
        lines.append(f"| `{key}` | `{default}` | {help_text.replace('|', '&#124;')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
