"""Copy the Python standard library's top-level modules into a folder: `make demo-lm`'s text.

Every machine with Python has this corpus, so the language-model demo needs no download. The
files are the `*.py` directly in `sysconfig.get_paths()["stdlib"]` (about 170 modules, 4.7 MB
for Python 3.11): no packages, hence no test suites (`test/`, `idlelib/idle_test/`) and
nothing pip installed (`site-packages/`). The set is a pure function of the Python that runs
this tool; the copies keep their names and bytes, and `SOURCES.txt` records the Python
version and the stdlib folder they came from.

Example::

    python tools/stdlib_corpus.py data/demo-lm/text
    hpctrain convert data/demo-lm/text data/demo-lm/shards --tokenizer bytes --text-glob '*.py'
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
from pathlib import Path


def stdlib_modules(stdlib: Path | None = None) -> list[Path]:
    """The top-level `*.py` files of the standard library, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"]) if stdlib is None else stdlib
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def copy_corpus(out_dir: Path, *, max_files: int = 0, stdlib: Path | None = None) -> list[Path]:
    """Copy the modules (the first `max_files` by name when > 0) into `out_dir`; their copies."""
    files = stdlib_modules(stdlib)
    if not files:
        raise SystemExit(f"stdlib_corpus.py: no *.py files in {stdlib or 'the stdlib folder'}")
    if max_files:
        files = files[:max_files]
    out_dir.mkdir(parents=True, exist_ok=True)
    copies = []
    for source in files:
        target = out_dir / source.name
        shutil.copyfile(source, target)
        copies.append(target)
    (out_dir / "SOURCES.txt").write_text(
        f"Python {sys.version.split()[0]} standard library, top-level modules of "
        f"{files[0].parent}:\n" + "".join(f"{p.name}\n" for p in files)
    )
    return copies


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="folder to copy the modules into")
    parser.add_argument(
        "--max-files", type=int, default=0, help="only the first N modules by name (0: all)"
    )
    args = parser.parse_args(argv)
    copies = copy_corpus(args.out_dir, max_files=args.max_files)
    total = sum(p.stat().st_size for p in copies)
    print(f"copied {len(copies)} modules ({total / 1e6:.1f} MB) to {args.out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
