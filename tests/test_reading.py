"""What a reader of minishard/ relies on beyond the size budgets (test_budgets.py): README's map
names every file, the source explains instead of remembering, and FlatBuffer stays small enough
to read alone (its layout arithmetic lives in zero/flat.py: Layout)."""
import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "minishard"
FLATBUFFER_LINES = 200

# Words that narrate the code's history rather than explain it: history lives in git and
# bench/RESULTS.md. (Ranks of a saved checkpoint are "saved ranks", never "old" ones.)
HISTORY = re.compile(r"\b(as before|used to|old|no longer|kept for|formerly|"
                     r"issue \d+|nowadays)\b", re.IGNORECASE)


def files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def history_lines(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if HISTORY.search(line)]


def test_readme_map_names_every_file():
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index("```\nminishard/\n"):]
    block = block[:block.index("\n```")]
    named, folder = set(), ""
    for indent, entry in re.findall(r"^( +)(\w+\.py|\w+/)", block, re.MULTILINE):
        if entry.endswith("/") and len(indent) == 2:
            folder = entry
        elif entry.endswith(".py") and len(indent) <= 4:
            named.add(entry if len(indent) == 2 else folder + entry)
    missing = {p.relative_to(PACKAGE).as_posix() for p in files()} - named
    missing = {m for m in missing if not m.endswith("__init__.py")}
    assert not missing, f"README's map of minishard/ does not name {sorted(missing)}"


@pytest.mark.parametrize("path", files(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_no_comment_narrates_history(path):
    assert history_lines(path.read_text()) == []


def test_the_history_check_can_fail():
    assert history_lines("x = 1  # kept as before\n# the old path") != []
    assert history_lines("x = 1  # rows of saved ranks\n") == []


def test_flatbuffer_reads_alone():
    tree = ast.parse((PACKAGE / "zero" / "flat.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "FlatBuffer")
    assert cls.end_lineno - cls.lineno + 1 <= FLATBUFFER_LINES
