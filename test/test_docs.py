"""The documentation a user reads: short README, links that resolve, every switch documented, the product's own
voice (no development history), and results kept as data."""

import ast
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", ROOT / "results" / "README.md",
        *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _file_links(path: pathlib.Path) -> list[str]:
    return [target for target in LINK.findall(path.read_text()) if not re.match(r"[a-z]+:", target)]


def test_the_docs_exist_and_link_to_files():
    assert len(DOCS) >= 8 and all(path.exists() for path in DOCS)
    assert len(_file_links(ROOT / "README.md")) >= 8


@pytest.mark.parametrize("path", DOCS, ids=lambda path: str(path.relative_to(ROOT)))
def test_every_link_to_a_file_resolves(path):
    missing = [target for target in _file_links(path) if not (path.parent / target.split("#")[0]).exists()]
    assert missing == [], f"{path.name} links to missing files: {missing}"


def test_the_link_check_finds_a_missing_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("[here](here.md) [gone](gone.md#part) [web](https://example.com)")
    (tmp_path / "here.md").write_text("")
    assert [t for t in _file_links(page) if not (tmp_path / t.split("#")[0]).exists()] == ["gone.md#part"]


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 250


# The words that tell how the project was made rather than what it is: the name of a stretch of work (spelled in
# parts here, so that the check does not find itself) and numbered tickets.
WORK_PERIOD, TICKET = "ses" + "sion", "iss" + "ue"


def _history_words(text: str) -> list[str]:
    """Development-history wording: the name of a stretch of work, in any number and case (a pytest fixture's scope
    of that name is code, not history), and ticket numbers."""
    found = re.findall(rf"(?i)\b{WORK_PERIOD}s?\b", text.replace(f'scope="{WORK_PERIOD}"', ""))
    found += re.findall(rf"(?i)\b{TICKET}[ -]?#?\d+", text)
    return found


def test_the_product_speaks_of_the_product():
    folders = ["docs", "benchmarks", "tools", "inductor_overlay", "torch_patches", "flashlight"]
    files = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", ROOT / "results" / "README.md"]
    files += [path for folder in folders for path in (ROOT / folder).rglob("*")
              if path.suffix in (".md", ".py", ".jinja", ".sh") and "__pycache__" not in path.parts]
    offenders = {str(path.relative_to(ROOT)): words for path in files if (words := _history_words(path.read_text()))}
    assert len(files) > 60 and offenders == {}


def test_the_history_check_finds_history():
    period, ticket = WORK_PERIOD.title(), TICKET
    sample = f"until the nineteenth {period}; see {ticket} #6 and {ticket} 36"
    assert _history_words(sample) == [period, f"{ticket} #6", f"{ticket} 36"]
    assert _history_words(f'@pytest.fixture(scope="{WORK_PERIOD}")') == []


def test_every_switch_is_documented():
    tree = ast.parse((ROOT / "inductor_overlay" / "config.py").read_text())
    switches = {node.target.id for node in tree.body if isinstance(node, ast.AnnAssign)}
    switches -= {"enabled"}  # flashlight.enable()/disable() set it; documented as those
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert len(switches) > 20
    assert sorted(name for name in switches if f"`{name}`" not in page) == []


def test_results_are_data():
    files = [path for path in (ROOT / "results").rglob("*") if path.is_file() and "latest" not in path.parts]
    assert 20 < len(files) < 200
    assert [path for path in files if path.suffix in (".py", ".sh")] == []
