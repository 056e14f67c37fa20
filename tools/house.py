"""The house rules `tests/test_house.py` checks, printable: `python tools/house.py`.

- no import cycle among hpctrain's modules, imports inside functions counted;
- no module over 600 lines;
- private torch/submitit names only in `compat_torch.py` / `compat_submitit.py`;
- imports run one way: each package sits on a floor (`FLOORS`) and imports only packages on
  lower floors. So tasks and models never import the loop (`train`), observe never imports
  the loop, parallel never imports tasks, and nothing below `launch` knows about SLURM jobs.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "hpctrain"
MAX_LINES = 600
COMPAT = {"hpctrain.compat_torch", "hpctrain.compat_submitit"}
PRIVATE_ROOTS = ("torch", "submitit")
# private methods reached through objects (no `torch.` in the expression to see)
PRIVATE_METHODS = {"_shutdown_workers", "_get_metadata_path", "_traverse", "_new_shared"}

# The floors of the house, lowest first: a package imports only packages on a lower floor
# (and itself). `hpctrain` is the top-level `__init__.py`, each other name a package or a
# top-level module under src/hpctrain/.
FLOORS: dict[str, int] = {
    "moved": 0,  # old module paths (imported by the top-level __init__)
    "errors": 0,
    "compat_torch": 0,
    "compat_submitit": 0,
    "hpctrain": 1,
    "files": 1,
    "toolchain": 1,  # what compiling kernels needs from the machine (no torch)
    "config": 2,
    "distributed": 3,  # who am I in the job, the process group
    "data": 4,
    "checkpoint": 4,
    "models": 5,  # builders, the GPT, foreign weights, init_from
    "parallel": 5,  # mesh, DDP/FSDP2/HSDP/TP, precision
    "observe": 5,  # metrics, trackers, hangs, profiling, plots
    "tasks": 6,  # the Task protocol and the built-in tasks
    "convert": 6,
    "train": 7,  # the loop
    "inference": 8,  # using a trained checkpoint
    # inside the allocation: attempts, restart policy, probe, rank watcher, goodput (no torch)
    "resilience": 9,
    "launch": 10,  # the login node's side: local, sbatch, submitit, preflight, status
    "bench": 11,
    "cli": 12,
    "__main__": 13,  # python -m hpctrain
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path, tree: ast.AST) -> set[str]:
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names.add(target)
            names.update(f"{target}.{alias.name}" for alias in node.names)
    return names


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    mods = modules(root)
    graph = {}
    for module, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        graph[module] = {m for m in _imported(module, path, tree) if m in mods and m != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def package_of(module: str) -> str:
    """`hpctrain.train.step` -> `train`; `hpctrain` -> `hpctrain`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def upward_imports(graph: dict[str, set[str]], floors: dict[str, int] = FLOORS) -> list[str]:
    """`a -> b (floor x -> y)` for each import from a package to one on its floor or above;
    `unplaced: p` for a package without a floor."""
    found = set()
    for module, imported in graph.items():
        here = package_of(module)
        if here not in floors:
            found.add(f"unplaced: {here}")
            continue
        for target in imported:
            there = package_of(target)
            if there != here and there in floors and floors[there] >= floors[here]:
                found.add(f"{module} -> {target} (floor {floors[here]} -> {floors[there]})")
    return sorted(found)


def long_modules(root: Path = ROOT) -> list[tuple[str, int]]:
    sizes = [(m, len(p.read_text().splitlines())) for m, p in modules(root).items()]
    return [(m, n) for m, n in sizes if n > MAX_LINES]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_uses(root: Path = ROOT) -> list[str]:
    """`module:line name` for each private torch/submitit name used outside the compat files."""
    uses = []
    for module, path in modules(root).items():
        if module in COMPAT:
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            hit = ""
            if (
                isinstance(node, ast.ImportFrom)
                and (node.module or "").split(".")[0] in PRIVATE_ROOTS
            ):
                parts = (node.module or "").split(".") + [a.name for a in node.names]
                hit = next((p for p in parts if _is_private(p)), "")
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    parts = alias.name.split(".")
                    if parts[0] in PRIVATE_ROOTS:
                        hit = hit or next((p for p in parts if _is_private(p)), "")
            elif isinstance(node, ast.Attribute):
                if node.attr in PRIVATE_METHODS:
                    hit = node.attr
                elif _is_private(node.attr):
                    base = node.value
                    while isinstance(base, ast.Attribute):
                        base = base.value
                    if isinstance(base, ast.Name) and base.id in PRIVATE_ROOTS:
                        hit = node.attr
            if hit:
                uses.append(f"{module}:{node.lineno} {hit}")
    return sorted(set(uses))


def main() -> int:
    problems = 0
    for component in cycles(import_graph()):
        print("cycle:", " <-> ".join(component))
        problems += 1
    for line in upward_imports(import_graph()):
        print("upward:", line)
        problems += 1
    for module, lines in long_modules():
        print(f"long: {module} {lines} lines (> {MAX_LINES})")
        problems += 1
    for use in private_uses():
        print("private:", use)
        problems += 1
    print(f"{problems} problem(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
