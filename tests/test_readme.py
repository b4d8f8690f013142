"""README.md is a product page, and keeps its shape: at most 300 lines, the main job's command on the first screen
(within the first 60 lines), no paragraph over 6 lines, every relative link leading to a file, the accuracy table
(the page's first table) at most 8 rows and 4 columns and the CPU table (its second) at most 6 columns, each with at
most 3 lines of text under it; and its two commands install one torch build, not two. Reads the file only."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
MAX_LINES, MAIN_JOB_BY, MAX_PARAGRAPH = 300, 60, 6
LIST_ITEM = re.compile(r"\s*(?:[-*+]|\d+[.)])\s")


def _lines() -> list[str]:
    return README.read_text().splitlines()


def _blocks() -> list[tuple[int, str, list[str]]]:
    """(first line number, kind, lines) of each block: 'code' (a fenced block), 'table', 'heading', 'list' or
    'paragraph' (prose lines in a row; a blank line, a table, a heading, a list or a fence ends it)."""
    blocks: list[tuple[int, str, list[str]]] = []
    in_code = False
    for n, line in enumerate(_lines(), 1):
        if line.startswith("```") or in_code:
            if line.startswith("```") and not in_code:
                blocks.append((n, "code", []))
            blocks[-1][2].append(line)
            in_code = in_code != line.startswith("```")  # a fence opens or closes it
            continue
        if not line.strip():
            blocks.append((n, "blank", []))
            continue
        kind = ("table" if line.lstrip().startswith("|") else "heading" if line.startswith("#")
                else "list" if LIST_ITEM.match(line) else "paragraph")
        if kind == "paragraph" and blocks and blocks[-1][1] == "list" and line.startswith((" ", "\t")):
            kind = "list"  # a list item's continuation
        if blocks and blocks[-1][1] == kind and kind != "heading":
            blocks[-1][2].append(line)
        else:
            blocks.append((n, kind, [line]))
    return [b for b in blocks if b[1] != "blank"]


def test_readme_is_at_most_300_lines():
    n = len(_lines())
    assert n <= MAX_LINES, (f"README.md is {n} lines; the product page holds at most {MAX_LINES}: move the story "
                            "and the footnotes to docs/ and benchmarks/results/README.md")


def test_the_main_job_stands_on_the_first_screen():
    starts = [n for n, kind, lines in _blocks() if kind == "code" and lines[0].startswith("```bash")
              and any("scripts/quickstart.sh" in line for line in lines)]
    assert starts, "README.md has no ```bash block running scripts/quickstart.sh (the main job)"
    assert starts[0] <= MAIN_JOB_BY, f"the main job's command starts on line {starts[0]}; it belongs within the " \
                                     f"first {MAIN_JOB_BY} lines"


def test_no_paragraph_is_over_six_lines():
    long = [f"line {n} ({len(lines)} lines): {lines[0][:60]}..." for n, kind, lines in _blocks()
            if kind == "paragraph" and len(lines) > MAX_PARAGRAPH]
    assert not long, f"paragraphs over {MAX_PARAGRAPH} lines: " + "; ".join(long)


def test_every_relative_link_resolves():
    text = README.read_text()
    targets = re.findall(r"\]\(\s*<?([^)>\s]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)
    relative = [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:|#", t)]
    assert relative, "README.md links no file of the repository"
    broken = [t for t in relative if not (README.parent / t.split("#")[0]).exists()]
    assert not broken, f"README.md links to nothing: {broken}"


def _tables() -> list[tuple[int, list[str], list[str]]]:
    """(first line number, the table's lines, the text right under it) per table, in order."""
    blocks = _blocks()
    out = []
    for i, (n, kind, lines) in enumerate(blocks):
        if kind == "table":
            after = blocks[i + 1] if i + 1 < len(blocks) else None
            out.append((n, lines, after[2] if after and after[1] == "paragraph" else []))
    return out


def _columns(table: list[str]) -> int:
    return len(table[0].strip().strip("|").split("|"))


def test_the_accuracy_and_cpu_tables_keep_their_size():
    tables = _tables()
    assert len(tables) >= 2, "README.md has an accuracy table and a CPU table"
    (n, accuracy, note), (m, cpu, cpu_note) = tables[:2]
    rows = len(accuracy) - 2  # less the header and its rule
    assert rows <= 8 and _columns(accuracy) <= 4, f"the accuracy table (line {n}) has {rows} rows and " \
                                                  f"{_columns(accuracy)} columns; at most 8 and 4"
    assert _columns(cpu) <= 6, f"the CPU table (line {m}) has {_columns(cpu)} columns; at most 6"
    for where, text in ((n, note), (m, cpu_note)):
        assert len(text) <= 3, f"the table on line {where} has {len(text)} lines of text under it; at most 3"


def test_the_two_commands_install_one_torch():
    """The main job's pip command and the test line's pin the same torch and torchvision, so a venv that ran both
    holds one build (a CPU build, 2.14.1+cpu, satisfies ==2.14.1: pip keeps it)."""
    text = README.read_text()
    pins = [tuple(re.findall(r"\b(torch|torchvision)==([\w.+]+)", line)) for line in text.splitlines()
            if "pip install" in line and "torch" in line and ("quickstart.sh" in line or "pytest" in line)]
    assert len(pins) == 2, f"README's two commands each install torch, pinned: {pins}"
    assert pins[0] == pins[1] and len(pins[0]) == 2, f"the two commands pin different torch builds: {pins}"
    assert "--index-url https://download.pytorch.org/whl/cpu" in text  # the CPU build, in one line
