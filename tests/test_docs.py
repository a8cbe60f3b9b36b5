"""Citations stay inside the repository, and every cited ``docs/<file>.md §N`` exists.

Code, tests and Markdown cite the project's own documents (``docs/contract.md``,
``docs/nki-semantics.md``, ``docs/cost-model.md``, ``docs/perf-log.md``, ...) by section number.
These tests fail when a file names a research note that lives outside the repository, cites a
``docs/`` file that does not exist, or cites a section number that the file has no heading for.
"""

from __future__ import annotations

import pathlib
import re

import pytest

import nki_lib
from nki_lib.simulator.profile import constants

ROOT = pathlib.Path(nki_lib.__file__).resolve().parent.parent
DOCS = ROOT / "docs"
_TEXT_SUFFIXES = {".py", ".md", ".toml", ".sh", ".txt", ".cfg", ".ini", ".yml", ".yaml", ".json", ".jsonl"}
_SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".hypothesis", ".ruff_cache", "build", "dist",
              "venv", ".venv", "node_modules"}

# Paths outside the repository that files used to cite; spelled in pieces so this file does not
# match itself.
_OUTSIDE = [re.compile(p) for p in (
    r"api-" + r"contract",
    r"nki-" + r"api\b",
    r"trainium-" + r"cost-model",
    r"shared/" + r"docs",
    r"\.\./" + r"shared",
    r"/work" + r"/",
    r"/tmp/" + r"simbugs",
)]

_DOC_CITE = re.compile(r"docs/([A-Za-z0-9_-]+\.md)")
_TOKEN = re.compile(r"\s*(?:§\s?(\d+(?:\.\d+)*)|([,/]|–|-|and\b|or\b)|(\d+(?:\.\d+)*))")
_HEADING = re.compile(r"^#{1,6}\s+(?:§\s?)?(\d+(?:\.\d+)*)\.?(?:\s|$)")


def _repo_files() -> list[pathlib.Path]:
    files = []
    for path in ROOT.rglob("*"):
        rel = path.relative_to(ROOT)
        if not path.is_file() or any(part in _SKIP_DIRS or part.endswith(".egg-info") for part in rel.parts):
            continue
        if path.suffix in _TEXT_SUFFIXES or rel.parts[0] in (".ci", "scripts"):
            files.append(path)
    return sorted(files)


FILES = _repo_files()


def _text(path: pathlib.Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


def cited_sections(tail: str) -> list[str]:
    """Section numbers cited right after a ``docs/<file>.md`` mention.

    ``tail`` starts after the file name. A citation is a run of ``§N`` items joined by commas,
    slashes, dashes (ranges: both ends are returned), "and" or "or"; after a separator the ``§``
    may be left out (``§8.2-8.5, 8.11``).
    """
    tail = tail.lstrip("`'\")")
    numbers: list[str] = []
    pos, after_separator = 0, False
    while True:
        m = _TOKEN.match(tail, pos)
        if m is None or m.end() == pos:
            break
        section, separator, bare = m.groups()
        if bare and not after_separator:
            break
        if separator and not numbers:
            break
        if section or bare:
            numbers.append(section or bare)
        after_separator = separator is not None
        pos = m.end()
    return numbers


def doc_sections(name: str) -> set[str]:
    """The section numbers that ``docs/<name>`` has a heading for."""
    found = set()
    for line in _text(DOCS / name).splitlines():
        m = _HEADING.match(line)
        if m:
            found.add(m.group(1))
    return found


def test_the_cited_documents_exist():
    for name in ("contract.md", "nki-semantics.md", "cost-model.md", "perf-log.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"
    assert (ROOT / "CONTRIBUTING.md").is_file()


def test_no_file_cites_a_path_outside_the_repository():
    offenders = []
    for path in FILES:
        for lineno, line in enumerate(_text(path).splitlines(), 1):
            if any(p.search(line) for p in _OUTSIDE):
                offenders.append(f"{path.relative_to(ROOT)}:{lineno}: {line.strip()[:120]}")
    assert not offenders, "cite docs/ in this repository instead:\n" + "\n".join(offenders)


def test_every_cited_docs_section_exists():
    sections: dict[str, set[str]] = {}
    offenders = []
    for path in FILES:
        for lineno, line in enumerate(_text(path).splitlines(), 1):
            for m in _DOC_CITE.finditer(line):
                name = m.group(1)
                where = f"{path.relative_to(ROOT)}:{lineno}"
                if not (DOCS / name).is_file():
                    offenders.append(f"{where}: docs/{name} does not exist")
                    continue
                if name not in sections:
                    sections[name] = doc_sections(name)
                for number in cited_sections(line[m.end():]):
                    if number not in sections[name]:
                        offenders.append(f"{where}: docs/{name} has no section {number}")
    assert not offenders, "\n".join(offenders)


def test_cost_model_constants_cite_existing_sections():
    sections = doc_sections("cost-model.md")
    assert constants.DOC == "docs/cost-model.md"
    offenders = []
    for target, table in constants.TARGETS.items():
        for name, param in table.items():
            if constants.DOC not in param.source:
                continue
            for number in cited_sections(param.source.split(constants.DOC, 1)[1]):
                if number not in sections:
                    offenders.append(f"{target}.{name}: {param.source}")
    assert not offenders, "constants cite missing sections of docs/cost-model.md:\n" + "\n".join(offenders)


@pytest.mark.parametrize("tail, expected", [
    (" §3.", ["3"]),
    ("`` §7.2 (compute engines) or §7.3", ["7.2"]),
    (" §8.2-8.5, 8.11, 8.12, 8.21-8.23, 8.27).", ["8.2", "8.5", "8.11", "8.12", "8.21", "8.23", "8.27"]),
    (" §8.20–§8.28) including", ["8.20", "8.28"]),
    (" §2.5, NC-v2 arch guide", ["2.5"]),
    (" §14 item 13", ["14"]),
    (" §1.2 128 partitions / compute lanes", ["1.2"]),
    (" (the contract)", []),
    (" 2024 notes", []),
])
def test_citation_parser(tail, expected):
    assert cited_sections(tail) == expected
