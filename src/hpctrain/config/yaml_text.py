"""Config YAML as hpctrain reads it: safe, YAML 1.2 numbers, no duplicate keys, bounded.

`load_yaml` parses a config (or a saved one); `load_config` reads files through
`TextKeepingLoader`, which keeps the text of unquoted booleans, numbers and dates (`Plain`)
so that a string-typed key takes what was written.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

import yaml


class ConfigYamlLoader(yaml.SafeLoader):
    """YAML without 1.1's base-60 numbers: `time: 20:00:00` stays the string "20:00:00".

    PyYAML follows YAML 1.1, where `20:00:00` is the integer 72000 (and SLURM would read
    "72000" as minutes). Exponents without a dot (`lr: 1e-3`) are floats here, as in YAML 1.2.
    Nesting stops at MAX_YAML_DEPTH while composing: the composer recurses once per level.
    """

    _depth = 0

    def compose_node(self, parent: yaml.Node | None, index: Any) -> yaml.Node | None:  # type: ignore[override]
        self._depth += 1
        try:
            if self._depth > MAX_YAML_DEPTH:
                mark = self.peek_event().start_mark
                raise YamlRefused(
                    f"nested deeper than {MAX_YAML_DEPTH} levels (line {mark.line + 1})"
                )
            return super().compose_node(parent, index)  # type: ignore[no-any-return]
        finally:
            self._depth -= 1


_INT_TAG, _FLOAT_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:float"
ConfigYamlLoader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag not in (_INT_TAG, _FLOAT_TAG)]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
ConfigYamlLoader.add_implicit_resolver(
    _INT_TAG,
    re.compile(r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o?[0-7_]+|0b[01_]+)$"),
    list("-+0123456789"),
)
ConfigYamlLoader.add_implicit_resolver(
    _FLOAT_TAG,
    re.compile(
        r"^(?:[-+]?[0-9][0-9_]*\.[0-9_]*(?:[eE][-+]?[0-9]+)?|[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+"
        r"|[-+]?\.[0-9_]+(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+0123456789."),
)


class YamlRefused(yaml.YAMLError):
    """YAML that parses but is refused (a duplicate key); the message says why, not where."""


_MERGE_TAG = "tag:yaml.org,2002:merge"


# Far beyond any config (a mixture source is 4 levels deep), far below Python's recursion limit
# (the composer and every tree walk recurse once per level).
MAX_YAML_DEPTH = 100
# Values once aliases are expanded: a 900-byte alias bomb holds billions.
MAX_YAML_VALUES = 100_000


def check_tree(root: yaml.Node) -> None:
    """Raise YamlRefused for a duplicate key, too deep a tree or too many values, at any depth.

    PyYAML keeps the last value of a key given twice silently, so a second `train:` block
    would replace the whole first one; merge keys (`<<: *base`) are YAML's way of overriding
    and stay allowed. Depth and size are counted with aliases expanded (each node is measured
    once), before anything is built from the tree.
    """
    measured: dict[int, tuple[int, int]] = {}  # id(node) -> (values, levels), aliases expanded
    open_nodes: set[int] = set()

    def too_deep(node: yaml.Node) -> YamlRefused:
        return YamlRefused(
            f"nested deeper than {MAX_YAML_DEPTH} levels (line {node.start_mark.line + 1})"
        )

    def walk(node: yaml.Node, path: str, depth: int) -> tuple[int, int]:
        if depth > MAX_YAML_DEPTH:
            raise too_deep(node)
        if id(node) in measured:  # an alias of a node already measured
            values, levels = measured[id(node)]
            if depth + levels - 1 > MAX_YAML_DEPTH:
                raise too_deep(node)
            return values, levels
        if id(node) in open_nodes:
            raise YamlRefused(
                f"{path or 'the document'}: an alias inside the node it names "
                f"(line {node.start_mark.line + 1}): a structure without end"
            )
        open_nodes.add(id(node))
        children: list[tuple[yaml.Node, str]] = []
        if isinstance(node, yaml.SequenceNode):
            children = [(item, f"{path}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}
            for key, value in node.value:
                name = str(key.value) if isinstance(key, yaml.ScalarNode) else "?"
                dotted = f"{path}.{name}" if path else name
                if isinstance(key, yaml.ScalarNode) and key.tag != _MERGE_TAG:
                    line = key.start_mark.line + 1
                    if (key.tag, key.value) in lines:
                        raise YamlRefused(
                            f"duplicate key {dotted!r} at lines {lines[key.tag, key.value]} "
                            f"and {line} (the second would replace the first)"
                        )
                    lines[key.tag, key.value] = line
                children += [(key, dotted), (value, dotted)]
        values, levels = 1, 1
        for child, child_path in children:
            child_values, child_levels = walk(child, child_path, depth + 1)
            values, levels = values + child_values, max(levels, child_levels + 1)
            if values > MAX_YAML_VALUES:
                raise YamlRefused(
                    f"more than {MAX_YAML_VALUES} values once its aliases are expanded "
                    f"(line {node.start_mark.line + 1}): an alias bomb?"
                )
        open_nodes.discard(id(node))
        measured[id(node)] = (values, levels)
        return values, levels

    walk(root, "", 1)


@dataclasses.dataclass(frozen=True)
class Plain:
    """An unquoted YAML scalar read as a boolean, number or date, with the text it was written as.

    A string-typed key takes the text (`logging.wandb: off` is "off", not False; `slurm.qos:
    yes` is "yes"; `logging.run_name: 2024-01-01` is not a date; `slurm.account: 0123` is not
    83); every other key takes the value. Only `load_config` sees these: `_coerce` unwraps them.
    """

    value: Any
    text: str

    def __repr__(self) -> str:  # messages show the value as YAML read it
        return repr(self.value)


class TextKeepingLoader(ConfigYamlLoader):
    """The config loader, with its booleans, numbers and dates wrapped in `Plain`."""


def keeping_text(tag: str) -> Any:
    construct_value = yaml.SafeLoader.yaml_constructors[tag]

    def construct(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> Any:
        return Plain(construct_value(loader, node), str(node.value))

    return construct


for _tag in ("bool", "int", "float", "timestamp"):
    TextKeepingLoader.add_constructor(
        f"tag:yaml.org,2002:{_tag}", keeping_text(f"tag:yaml.org,2002:{_tag}")
    )


def plain_values(value: Any) -> Any:
    """`value` with every `Plain` inside it replaced by its value (for free-form keys)."""
    if isinstance(value, Plain):
        return value.value
    if isinstance(value, dict):
        return {plain_values(k): plain_values(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain_values(v) for v in value]
    return value


def load_yaml(text: str) -> Any:
    """Parse config YAML (safe: no Python objects; no base-60 numbers; no duplicate keys)."""
    return parse_yaml(text, ConfigYamlLoader)


def parse_yaml(text: str, loader_class: type[ConfigYamlLoader]) -> Any:
    loader = loader_class(text)  # a SafeLoader subclass: no Python objects
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_tree(node)
        return loader.construct_document(node)
    finally:
        loader.dispose()
