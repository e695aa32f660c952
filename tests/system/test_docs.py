"""The documentation speaks of the project, not of how it was developed, and its links resolve."""

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Development-history words: an issue or step number, "this stop", a working session.
HISTORY = re.compile(r"\b(issue|stop)s? \d+\b|\bthis stop\b|\bsession", re.IGNORECASE)


def _lines_matching(paths: list[Path], pattern: re.Pattern) -> list[str]:
    """`file:line: text` of every line of `paths` that `pattern` finds something in."""
    return [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in paths
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if pattern.search(line)
    ]


def _prose_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "benchmarks" / "RESULTS.md"]
    return files + sorted((ROOT / "docs").rglob("*.md"))


@pytest.mark.parametrize("path", _prose_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_docs_name_no_issue_number_or_development_step(path: Path) -> None:
    hits = _lines_matching([path], HISTORY)
    assert not hits, "development history in the docs (say what is, not when it was done):\n" + "\n".join(hits)


ISSUE_NUMBER = re.compile(r"\bissues? \d+", re.IGNORECASE)  # in code "session" is a word of its own (pytest, HTTP)


def _source_files() -> list[Path]:
    """The repository's code and configuration, without hidden folders (venvs, caches) or build outputs."""
    suffixes, skipped = {".py", ".sh", ".yaml", ".yml", ".toml", ".j2", ".cfg"}, {"site", "runs", "dist", "build"}
    files = []
    for folder, subfolders, names in os.walk(ROOT):
        subfolders[:] = [d for d in subfolders if not d.startswith(".") and d not in skipped and d != "__pycache__"]
        files += [Path(folder) / n for n in names if Path(n).suffix in suffixes or n == "Makefile"]
    return sorted(files)


def test_code_names_no_issue_number() -> None:
    """Comments and docstrings say why, not which issue asked: the numbers mean nothing to a reader."""
    hits = _lines_matching([p for p in _source_files() if p != Path(__file__).resolve()], ISSUE_NUMBER)
    assert not hits, "issue numbers in code (say why, not which issue asked):\n" + "\n".join(hits)


def test_history_pattern_catches_what_it_must() -> None:
    for bad in ["## Chaos runs (issue 29)", "measured in stop 25", "Issues 4, 5", "this stop's run", "the previous session"]:
        assert HISTORY.search(bad), bad
    for good in ["the issue's cause", "a bus stop", "stop the search after 45 generations", "issued 3 requests"]:
        assert not HISTORY.search(good), good


def _github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("name", ["README.md", "CHANGELOG.md", "benchmarks/RESULTS.md"])
def test_relative_links_resolve(name: str) -> None:
    """Every relative link of the front pages points at a file of the repository (and an anchor at a heading)."""
    path = ROOT / name
    text = path.read_text(encoding="utf-8")
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or name != "README.md"
    broken = []
    for link in links:
        if re.match(r"^[a-z]+:", link):
            continue
        target, _, anchor = link.partition("#")
        file = (path.parent / target).resolve() if target else path
        if not file.exists():
            broken.append(link)
        elif anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.+?)(?: \{#([\w-]+)\})?$", file.read_text(encoding="utf-8"), flags=re.MULTILINE)
            if anchor not in {explicit or _github_slug(title) for title, explicit in headings}:
                broken.append(link)
    assert not broken, f"{name}: broken links {broken}"


def test_architecture_page_stays_a_map() -> None:
    """The architecture page is a map that links the details; the details live on the explanation pages."""
    size = (ROOT / "docs" / "ARCHITECTURE.md").stat().st_size
    assert size < 16_000, f"docs/ARCHITECTURE.md is {size:,} bytes: move details to docs/explanation/ and link them"


# A count of all the stages written out ("runs as nine stages", "the eight stage verbs"): it goes stale when a stage is
# added. Name the stages, or say "the stages"; the CLI's help counts them from the registry.
STAGE_COUNT = re.compile(
    r"\b(?:the|in|as|its|all|of)\s+(?:two|three|four|five|six|seven|eight|nine|ten|eleven|twelve|\d+)\s+"
    r"(?:pipeline\s+)?(?:stage verbs|stages|verbs)\b",
    re.IGNORECASE,
)


@pytest.mark.parametrize(
    "path", [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))], ids=lambda p: str(p.relative_to(ROOT))
)
def test_docs_do_not_count_the_stages_in_words(path: Path) -> None:
    hits = _lines_matching([path], STAGE_COUNT)
    assert not hits, "a hard-coded count of the stages goes stale; name them or say 'the stages':\n" + "\n".join(hits)


def test_stage_count_pattern_catches_what_it_must() -> None:
    for bad in ["It runs as nine stages (calibrate", "lists the eight stage verbs", "in 9 stages", "all seven pipeline stages"]:
        assert STAGE_COUNT.search(bad), bad
    for good in ["it runs two stages at once (the grid's branches)", "the stages", "every stage verb"]:
        assert not STAGE_COUNT.search(good), good
