"""Every Python snippet in docs/ and README.md runs: each page's blocks in order,
one namespace.

A block preceded by the line ``<!-- skip-test: reason -->`` is left out (for
snippets that need several processes or a GPU); the reason must be given.
"""

import pathlib
import re

import pytest

# Minutes in all: behind the marker; CI runs them with `pytest -m slow`.
pytestmark = pytest.mark.slow

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!-- skip-test: [^>]+-->\s*\n)?```python\n(.*?)```", re.S)


def python_blocks(page: pathlib.Path) -> list[str]:
  return python_blocks_of(page.read_text())


def python_blocks_of(text: str) -> list[str]:
  return [code for skip, code in BLOCK.findall(text) if not skip]


README = DOCS.parent / "README.md"
PAGES = [*sorted(p for p in DOCS.glob("*.md") if python_blocks(p)), README]


def test_the_docs_have_snippets():
  assert len(PAGES) >= 3, PAGES


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_snippets_run(page):
  namespace: dict = {"__name__": f"docs_{page.stem}"}
  for i, code in enumerate(python_blocks(page)):
    try:
      exec(compile(code, f"{page.name}[block {i}]", "exec"), namespace)
    except Exception as error:
      raise AssertionError(f"{page.name}, block {i} failed:\n{code}") from error


def test_the_readme_training_step_prints_what_the_readme_shows(capsys):
  section = README.read_text().split("\n## A training step\n")[1].split("\n## ")[0]
  (code,) = python_blocks_of(section)
  shown = re.search(r"```text\n(.*?)```", section, re.S)
  assert shown, "the README shows no output for its training step"
  exec(compile(code, "README.md[A training step]", "exec"), {"__name__": "readme_step"})
  assert capsys.readouterr().out == shown.group(1)
