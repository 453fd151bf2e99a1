"""The repository's docs stand on their own: nothing points outside it, and every link resolves."""

from __future__ import annotations

import re
from pathlib import Path

from tests.procs import ROOT

# Documents that exist only beside the repository, never in it (spelled in pieces so that this
# file does not match itself).
OUTSIDE = (
    "../" + "shared",
    "/work" + "/",
    "reference" + "/sglang-contract",
    "reference" + "/streaming-costs",
)
SKIP_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    ".ruff_cache",
    ".mypy_cache",
    ".pytest_cache",
    ".hypothesis",
    "tokenmill.egg-info",
}
TEXT_SUFFIXES = {".py", ".md", ".lua", ".toml", ".yaml", ".yml", ".txt", ".cfg", ".ini", ""}


def repo_files() -> list[Path]:
    files = []
    for path in ROOT.rglob("*"):
        if any(part in SKIP_DIRS for part in path.relative_to(ROOT).parts):
            continue
        if path.is_file() and (path.suffix in TEXT_SUFFIXES or path.name in ("Makefile", "Dockerfile")):
            files.append(path)
    return files


def test_nothing_in_the_repository_points_outside_it() -> None:
    found = [
        f"{path.relative_to(ROOT)}: {needle}"
        for path in repo_files()
        for needle in OUTSIDE
        if needle in path.read_text(errors="replace")
    ]
    assert not found, found


def test_the_readme_links_the_architecture_and_every_relative_link_resolves() -> None:
    assert "](docs/architecture.md)" in (ROOT / "README.md").read_text()
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text()):
            if "://" in target or target.startswith(("#", "mailto:")):
                continue
            if not (doc.parent / target.split("#", 1)[0]).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken


def test_the_readme_shows_the_batch_api_code_the_api_tests_run() -> None:
    # Given the README's "Drop-in for OpenAI's Batch API" code and the code tests/test_api.py runs
    from tests.test_api import DROP_IN

    # Then they are the same lines
    assert DROP_IN in (ROOT / "README.md").read_text()


# How long the front pages may grow: the README is where a newcomer starts and the benchmarks page
# holds the current figures; the manual is in docs/ and the dated history in docs/benchmarks-history/.
README_MAX_LINES = 160
BENCHMARKS_MAX_LINES = 220


def test_the_readme_and_the_benchmarks_page_stay_short() -> None:
    # Given the README and docs/benchmarks.md
    readme = (ROOT / "README.md").read_text().splitlines()
    benchmarks = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()

    # Then each is within its bound
    assert len(readme) <= README_MAX_LINES, f"README.md has {len(readme)} lines; move the manual into docs/"
    assert len(benchmarks) <= BENCHMARKS_MAX_LINES, (
        f"docs/benchmarks.md has {len(benchmarks)} lines; move dated runs into docs/benchmarks-history/"
    )


def test_every_benchmark_history_file_is_linked_from_the_benchmarks_page() -> None:
    # Given the history files and the links of docs/benchmarks.md
    history = sorted((ROOT / "docs" / "benchmarks-history").glob("*.md"))
    text = (ROOT / "docs" / "benchmarks.md").read_text()
    linked = {target.split("#", 1)[0] for target in re.findall(r"\]\(([^)\s]+)\)", text)}

    # Then there is history, and every file of it is linked
    assert history, "docs/benchmarks-history/ holds no history"
    unlinked = [path.name for path in history if f"benchmarks-history/{path.name}" not in linked]
    assert not unlinked, f"docs/benchmarks.md links none of {unlinked}"
