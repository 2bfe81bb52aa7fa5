"""Fenced code blocks of the documentation and the READMEs, with their markers.

A block's marker is an HTML comment on the line right before its opening fence:

- ``<!-- gpu -->``: runs only where CUDA is available (``pytest -m gpu`` selects them);
- ``<!-- vllm -->``: needs vLLM 0.33 on a GPU and model weights; runs only with
  ``MLA_DOCS_VLLM=1`` (``pytest -m vllm``);
- ``<!-- run -->``: a ``bash`` block that is run (bash blocks are not run otherwise);
- ``<!-- continue -->``: a ``python`` block that continues the previous python block
  of the page (the two run as one program);
- ``<!-- norun: reason -->``: a ``python`` block that is shown only (say why);
- ``<!-- mla_quant -->``: a ``json`` block that is an ``mla_quant`` configuration,
  validated by ``mla_vllm.config`` (``test_config_reference.py``).

Every other ``python`` block runs on a CPU with ``TRITON_INTERPRET=1``. Blocks not
meant to run at all (output, signatures) are fenced as ``text``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> *)(?P<fence>```+|~~~+)(?P<info>[^`\n]*)$")
MARKER = re.compile(r"^\s*<!--\s*(?P<name>[a-z_]+)(?::\s*(?P<arg>.*?))?\s*-->\s*$")
MARKERS = frozenset({"gpu", "vllm", "run", "continue", "norun", "mla_quant"})


@dataclass
class Block:
    """One fenced block: where it is, its language, its markers and its source."""

    path: Path
    line: int  # 1-based line of the opening fence
    lang: str
    source: str
    markers: dict[str, str] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def documents() -> list[Path]:
    """docs/**/*.md, the root README.md and every package's README.md."""
    docs = sorted((ROOT / "docs").rglob("*.md"))
    readmes = [ROOT / "README.md", *sorted((ROOT / "packages").glob("*/README.md"))]
    return [p for p in [*docs, *readmes] if p.is_file()]


def blocks(path: Path) -> list[Block]:
    """The fenced blocks of one Markdown file, in order."""
    lines = path.read_text().splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        match = FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        indent, fence = len(match["indent"]), match["fence"]
        lang = match["info"].strip().split(" ")[0].lower()
        markers: dict[str, str] = {}
        j = i - 1
        while j >= 0 and (m := MARKER.match(lines[j])):
            if m["name"] not in MARKERS:
                raise ValueError(f"{path}:{j + 1}: unknown marker {m['name']!r}")
            markers[m["name"]] = m["arg"] or ""
            j -= 1
        body: list[str] = []
        k = i + 1
        while k < len(lines) and not lines[k].strip().startswith(fence):
            body.append(lines[k][indent:] if lines[k][:indent].strip() == "" else lines[k])
            k += 1
        if k == len(lines):
            raise ValueError(f"{path}:{i + 1}: unclosed code fence")
        found.append(Block(path, i + 1, lang, "\n".join(body) + "\n", markers))
        i = k + 1
    return found


def all_blocks() -> list[Block]:
    return [b for p in documents() for b in blocks(p)]
