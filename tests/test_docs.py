"""Every Python snippet in docs/ runs: each page's blocks in order, one namespace.

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
  return [code for skip, code in BLOCK.findall(page.read_text()) if not skip]


PAGES = sorted(p for p in DOCS.glob("*.md") if python_blocks(p))


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
