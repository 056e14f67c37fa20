"""The shell blocks of README.md and docs/*.md, and what the docs tier does with each.

A block is a fenced code block whose info string is ``bash``, ``sh``, ``shell`` (commands,
run in order in one ``bash -eo pipefail``) or ``console`` (a transcript: ``$ COMMAND`` lines,
each followed by the output it shows, compared after masking). Fences may be indented (a
block inside a list item). An HTML comment on the line before the fence steers the test:

    <!-- docs-test: skip slurm: needs sbatch and a cluster -->   not run; the reason is shown
    <!-- docs-test: slow -->                                    only in `make test`
    <!-- docs-test: quick -->                                   also in `make test-fast`

Without one, a block that trains or reads a trained run (``hpctrain train``, ``eval``,
``predict``, ``export``, ``generate``, ``plot``, an example's data generator) is slow and the
others are quick. Single lines that need what this machine lacks are skipped by the rules of
`LINE_SKIPS`, placeholders and sizes are replaced by `SUBSTITUTIONS`: both are the documented
set docs/testing.md points to. A skipped ``hpctrain`` line still parses: in its place the
block runs `tests/support/doc_parse.py` with the same words (the verb's own parser, then the
config file with its overrides and, for a SLURM verb, the job on its profile), so a command
that needs a cluster or a download is checked as far as this machine can check it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

SHELL_INFOS = ("bash", "sh", "shell")
TRANSCRIPT_INFOS = ("console",)
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")
ANNOTATION = re.compile(r"^\s*<!--\s*docs-test:\s*(?P<what>.*?)\s*-->\s*$")

# Placeholders and sizes the tier replaces in every command, in this order: (pattern, text, why).
SUBSTITUTIONS: tuple[tuple[str, str, str], ...] = (
    (r"\[key\.sub=value \.\.\.\]", "", "a synopsis's optional overrides"),
    (r"(?<![\w/])IMAGES/", "data/demo/images/", "an image folder: the demo's"),
    (r"(?<![\w/])SHARDS/", "data/shards/", "a shards folder in the scratch"),
    (r"(?<![\w/])RUN_DIR\b", "runs/demo", "a run folder: the demo's"),
    (r"(?<![\w/])CONFIG\b", "configs/demo.yaml", "a config: the demo's"),
    (r"--profile P\b", "--profile local-dev", "a cluster profile"),
    (r"\bstep-400\b", "step-4", "the scratch demo run saves steps 2 and 4, not 400"),
    (
        r"(make_demo_data\.py \S+)(?!.*--num-images)",
        r"\1 --num-images 300",
        "the demo's 3,000 generated images: 300",
    ),
    (
        r"(stdlib_corpus\.py)(?!.*--max-files)",
        r"\1 --max-files 100",
        "the standard library's 168 top-level modules: 100",
    ),
    (
        r"(make_data\.py data/seg)(?!\S)",
        r"\1 --train 32 --val 16",
        "the segmentation example's 400 + 100 pairs: 32 + 16",
    ),
)

# Lines that are not run, with the reason: (pattern matched against the command, reason).
LINE_SKIPS: tuple[tuple[str, str], ...] = (
    (r"s3://", "s3: needs an S3 endpoint and a bucket"),
    (r"^sbatch\b", "slurm: needs a SLURM cluster"),
    (r"^hpctrain status\b", "slurm: needs a run with a SLURM job"),
    (r"^hpctrain submit\b(?!.*--no-preflight)", "slurm: submits a job (or preflights a site)"),
    (
        r"^hpctrain (sbatch|preflight)\b(?=.*--profile jean-zay)(?!.*--no-preflight)",
        "slurm: the site's preflight runs its `module` lines, which only a Jean Zay node has",
    ),
    (r"^hpctrain sync\b(?!.*--dry-run)", "network: uploads to W&B"),
    (r"^make (demo|demo-lm|test)\b", "long: the demos and the whole suite (run in CI)"),
    (r"^(hf|huggingface-cli) download\b", "network: downloads from the Hugging Face hub"),
    (r"^source \S*bin/activate\b", "install: the suite runs in its own venv already"),
    (
        r"^(\S*/)?pip install\b",
        "install: a page's install line (the suite's venv holds every extra: the dev extra)",
    ),
)

# A documented hpctrain command (or a venv's `bin/hpctrain`): a skipped one still parses.
HPCTRAIN_COMMAND = re.compile(r"^(?:\S*/)?hpctrain\s+(?P<words>.*)$", re.DOTALL)

# Commands that train or read a trained run: a block holding one is slow unless annotated.
SLOW_COMMAND = re.compile(
    r"^(hpctrain (train|eval|predict|export|generate|plot)\b|python \S*make_data\.py)"
)
# A bare fence that opens with one of these is a shell block missing its info string.
LOOKS_LIKE_SHELL = re.compile(r"^(\$ |hpctrain [a-z-]+\s|make [a-z]|python3? \S+\.py)")
DIAGRAM = re.compile("[─►├└│]")  # a bare fence drawing the path of a run, not commands


@dataclass(frozen=True)
class Command:
    line: int  # 1-based line of the document where the command starts
    text: str  # continuation lines joined; comments kept (bash ignores them)
    expected: str = ""  # a transcript's shown output
    skip: str = ""  # why it is not run ("" runs it)

    @property
    def parse_words(self) -> str:
        """The words after `hpctrain` of a skipped command the tier parses instead ("": none)."""
        match = HPCTRAIN_COMMAND.match(self.text.strip())
        return match["words"] if self.skip and match else ""


@dataclass(frozen=True)
class Block:
    doc: str  # the document's path relative to the repo root
    line: int  # 1-based line of the opening fence
    info: str  # the fence's info string
    body: str
    annotation: str = ""  # the docs-test comment before the fence, if any
    commands: tuple[Command, ...] = field(default=())
    after_slow: bool = False  # a slow block comes before it in its document

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def transcript(self) -> bool:
        return self.info in TRANSCRIPT_INFOS

    @property
    def skip(self) -> str:
        """Why the block is not run at all ("" when some of it runs or parses)."""
        if any(not c.skip or c.parse_words for c in self.commands):
            return ""
        reasons = [c.skip for c in self.commands]
        return "; ".join(dict.fromkeys(reasons)) or annotation_skip(self.annotation) or "empty"

    @property
    def parse_only(self) -> bool:
        """Every command is skipped and at least one parses: no command of the block runs."""
        return not self.skip and all(c.skip for c in self.commands)

    @property
    def slow(self) -> bool:
        if self.annotation in ("slow", "quick"):
            return self.annotation == "slow"
        if self.transcript:
            return False
        if self.parse_only:  # its config may be a file a slow block above it wrote
            return self.after_slow
        return any(SLOW_COMMAND.match(c.text) for c in self.commands if not c.skip)


def annotation_skip(annotation: str) -> str:
    """The reason of a `skip REASON` annotation ("" for any other)."""
    if not annotation.startswith("skip"):
        return ""
    return annotation[4:].strip() or "skipped"


def substitute(command: str) -> str:
    for pattern, text, _ in SUBSTITUTIONS:
        command = re.sub(pattern, text, command)
    return command


def line_skip(command: str) -> str:
    stripped = command.strip()
    for pattern, reason in LINE_SKIPS:
        if re.search(pattern, stripped):
            return reason
    return ""


def fences(doc: str, text: str) -> list[tuple[int, str, str, str]]:
    """(line of the opening fence, info string, body, annotation) for every fenced block."""
    lines = text.splitlines()
    out: list[tuple[int, str, str, str]] = []
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, info = m["indent"], m["fence"], m["info"].strip()
        j = i + 1
        while j < len(lines) and not (
            lines[j].strip().startswith(fence) and lines[j].strip().strip(fence[0]) == ""
        ):
            j += 1
        if j == len(lines):
            raise ValueError(f"{doc}:{i + 1}: fence never closed")
        body = "\n".join(
            line[len(indent) :] if line.startswith(indent) else line.lstrip()
            for line in lines[i + 1 : j]
        )
        k = i - 1
        while k >= 0 and not lines[k].strip():
            k -= 1
        note = ANNOTATION.match(lines[k]) if k >= 0 else None
        out.append((i + 1, info, body, note["what"] if note else ""))
        i = j + 1
    return out


def _commands(
    first_line: int, body: str, transcript: bool, block_skip: str = ""
) -> tuple[Command, ...]:
    commands: list[Command] = []
    lines = body.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        if transcript and not raw.startswith("$ "):
            i += 1  # output before any command: nothing to compare it with
            continue
        start = i
        text = raw[2:] if transcript else raw
        while text.endswith("\\") and i + 1 < len(lines):
            i += 1
            text = text[:-1] + " " + lines[i].strip()
        i += 1
        expected: list[str] = []
        if transcript:
            while i < len(lines) and not lines[i].startswith("$ "):
                expected.append(lines[i])
                i += 1
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        commands.append(
            Command(
                line=first_line + 1 + start,
                text=substitute(text),
                expected="\n".join(expected).strip("\n"),
                skip=block_skip or line_skip(text),
            )
        )
    return tuple(commands)


def shell_blocks(root: Path, docs: list[str]) -> list[Block]:
    """Every shell or console block of `docs` (paths relative to `root`), in document order."""
    blocks: list[Block] = []
    for doc in docs:
        after_slow = False
        for line, info, body, note in fences(doc, (root / doc).read_text(encoding="utf-8")):
            if info not in SHELL_INFOS + TRANSCRIPT_INFOS:
                continue
            transcript = info in TRANSCRIPT_INFOS
            commands = _commands(line, body, transcript, annotation_skip(note))
            block = Block(doc, line, info, body, note, commands, after_slow)
            blocks.append(block)
            after_slow = after_slow or (not block.skip and block.slow)
    return blocks


def untagged_shell(root: Path, docs: list[str]) -> list[str]:
    """`doc:line` of each bare fence that opens like a command: it should say bash/console."""
    found = []
    for doc in docs:
        for line, info, body, _ in fences(doc, (root / doc).read_text(encoding="utf-8")):
            first = next((b.strip() for b in body.splitlines() if b.strip()), "")
            if not info and LOOKS_LIKE_SHELL.match(first) and not DIAGRAM.search(body):
                found.append(f"{doc}:{line}")
    return found


MASKS: tuple[tuple[str, str], ...] = (
    (r"\d{4}-\d{2}-\d{2}", "<date>"),
    (r"\d{1,2}:\d{2}:\d{2}(\.\d+)?", "<time>"),
    (r"(?<![\w.])/[^\s'\",;:()]+", "<path>"),
    (r"\d+(\.\d+)?(e[-+]?\d+)?", "<n>"),
)


def mask(text: str) -> str:
    """Times, dates, absolute paths and numbers replaced by placeholders; lines right-stripped."""
    for pattern, placeholder in MASKS:
        text = re.sub(pattern, placeholder, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def matches(expected: str, actual: str) -> bool:
    """Whether `actual` is the shown output, masked; `...` in the shown output matches anything."""
    pattern = ".*?".join(re.escape(part) for part in mask(expected).split("..."))
    return re.fullmatch(pattern, mask(actual), flags=re.DOTALL) is not None


def main() -> None:
    """Print every block of the docs and what the docs tier does with it."""
    root = Path(__file__).resolve().parents[2]
    docs = ["README.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").glob("*.md"))]
    for block in shell_blocks(root, docs):
        what = f"skip ({block.skip})" if block.skip else ("slow" if block.slow else "quick")
        if block.parse_only:
            what += ", parsed only"
        print(f"{block.id:22} {block.info:8} {what}")
        for c in block.commands:
            if c.skip and not block.skip:
                done = "parsed, not run" if c.parse_words else "not run"
                print(f"{'':22}   line {c.line} {done} ({c.skip})")


if __name__ == "__main__":
    main()
