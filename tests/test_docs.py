"""Every Python snippet in docs/ and README.md runs and prints what it shows.

Each page's ```python blocks run in order, in one namespace per page. A block
preceded by the line ``<!-- skip-test: reason -->`` is left out (for snippets
that need several processes or a GPU); the reason must be given.

**Shown outputs are checked.** Each block runs one top-level statement at a
time, with its stdout captured. A statement that calls ``print`` shows its
output in the comment on its last line and in the comment lines directly
below it (no blank line between)::

  print(x.dtype)  # bfloat16
  for name in ("a", "b"):
    print(name, 1.0)
  # a 1.0
  # b 1.0

The statements directly above it (no blank line between) that print and show
nothing count as part of it: a block of prints can share its comment lines.

- Whitespace is normalised before comparing: runs of it become one space,
  and spaces just inside brackets go (numpy pads ``[0.5 0. ]``).
- Each comment line is one printed line; where their counts differ (a long
  value wrapped over several comment lines), all lines are joined into one.
- Prose may follow a shown value after ``:``, ``,`` or `` (``:
  ``# True: the masters are exact`` shows ``True``; so the value itself must
  be written in full, never as prose.
- ``...`` at the end of a shown value elides the rest: ``# 0.99...`` matches
  any output that starts ``0.99``, and ``# ...`` alone checks nothing. Use it
  only for values that are not stable (timings, addresses, random bytes).

A ``print`` with no comment at all is not checked (the README's training
loop); comments on statements that print nothing are prose.
"""

import ast
import contextlib
import io
import pathlib
import re
import tokenize

import pytest

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"
BLOCK = re.compile(r"(<!-- skip-test: [^>]+-->\s*\n)?```python\n(.*?)```", re.S)
PROSE = (":", ",", " (")
ELIDED = "..."


def python_blocks(page: pathlib.Path) -> list[str]:
  return python_blocks_of(page.read_text())


def python_blocks_of(text: str) -> list[str]:
  return [code for skip, code in BLOCK.findall(text) if not skip]


README = DOCS.parent / "README.md"
PAGES = [*sorted(p for p in DOCS.glob("*.md") if python_blocks(p)), README]


def normalised(text: str) -> str:
  """Runs of whitespace as one space, and none inside brackets' edges (numpy's padding)."""
  return re.sub(r"([\[(]) | (?=[\])])", r"\1", " ".join(text.split()))


def shows(expected: str, printed: str) -> bool:
  """Whether the shown value `expected` (prose allowed after it) is `printed`."""
  expected, printed = normalised(expected), normalised(printed)
  if expected.endswith(ELIDED):
    return printed.startswith(expected[: -len(ELIDED)].rstrip())
  return expected == printed or any(
    expected.startswith(printed + sep) and _is_prose(sep, expected[len(printed) + len(sep) :])
    for sep in PROSE
  )


def _is_prose(sep: str, rest: str) -> bool:
  """Whether what follows ``sep`` is prose: anything after ``:`` or `` (``; after
  a comma, words (``# 0.5, 0.25`` shows two values, not ``0.5`` and prose)."""
  rest = rest.lstrip()
  return sep != "," or rest[:1].isalpha() or rest[:1] == "`"


def shows_all(expected: list[str], printed: list[str]) -> bool:
  if len(expected) == len(printed):
    return all(shows(e, p) for e, p in zip(expected, printed, strict=True))
  return shows(" ".join(expected), " ".join(printed))


def comments(code: str) -> tuple[dict[int, str], set[int]]:
  """The text of each comment by line (1-based), and the lines that are only a comment."""
  text, alone = {}, set()
  for token in tokenize.generate_tokens(io.StringIO(code).readline):
    if token.type == tokenize.COMMENT:
      line = token.start[0]
      text[line] = token.string[1:].strip()
      if not token.line[: token.start[1]].strip():
        alone.add(line)
  return text, alone


def calls_print(node: ast.AST) -> bool:
  return any(
    isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "print"
    for n in ast.walk(node)
  )


def shown_output(statement: ast.stmt, text: dict[int, str], alone: set[int]) -> list[str]:
  """The comment lines that show what `statement` prints: its last line's, then those below."""
  end = statement.end_lineno
  assert end is not None
  shown = [text[end]] if end in text and end not in alone else []
  line = end + 1
  while line in alone:
    shown.append(text[line])
    line += 1
  return shown


def run_block(code: str, namespace: dict, name: str) -> list[str]:
  """Runs `code` statement by statement in `namespace`; returns each shown value it misses."""
  tree = ast.parse(code)
  text, alone = comments(code)
  misses, pending, previous_end = [], [], None
  for statement in tree.body:
    adjacent = previous_end is not None and statement.lineno == previous_end + 1
    if not adjacent:
      pending = []
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
      exec(compile(ast.Module([statement], []), name, "exec"), namespace)
    printed = out.getvalue().splitlines()
    shown = shown_output(statement, text, alone) if calls_print(statement) else []
    if shown:
      printed = pending + printed
      if not shows_all(shown, printed):
        misses.append(
          f"{name}, line {statement.lineno}: shows\n  "
          + "\n  ".join(shown)
          + "\nprints\n  "
          + "\n  ".join(printed)
        )
      pending = []
    else:
      pending = pending + printed if printed else []
    previous_end = statement.end_lineno
  return misses


def test_the_docs_have_snippets():
  assert len(PAGES) >= 3, PAGES


@pytest.mark.slow  # minutes in all; CI runs them with `pytest -m slow`
@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_page_snippets_run_and_print_what_they_show(page):
  namespace: dict = {"__name__": f"docs_{page.stem}"}
  misses = []
  for i, code in enumerate(python_blocks(page)):
    try:
      misses += run_block(code, namespace, f"{page.name}[block {i}]")
    except Exception as error:
      raise AssertionError(f"{page.name}, block {i} failed:\n{code}") from error
  assert not misses, "\n\n".join(misses)


@pytest.mark.slow
def test_the_readme_training_step_prints_what_the_readme_shows(capsys):
  section = README.read_text().split("\n## A training step\n")[1].split("\n## ")[0]
  (code,) = python_blocks_of(section)
  shown = re.search(r"```text\n(.*?)```", section, re.S)
  assert shown, "the README shows no output for its training step"
  exec(compile(code, "README.md[A training step]", "exec"), {"__name__": "readme_step"})
  assert capsys.readouterr().out == shown.group(1)


CHECKED = """\
x = 3  # prose on a statement that prints nothing
print(x)  # 3: prose after the value
for name in ("a", "b"):
  print(name, x)
# a 3 (the first)
# b 3
print({"k": [1, 2]})
# {'k':
#  [1, 2]}
print("elided", 0.123456)  # elided 0.12...
print("a")
print("b")
# a
# b
"""


def test_the_checker_passes_what_is_shown():
  assert run_block(CHECKED, {}, "checked") == []


@pytest.mark.parametrize(
  "code",
  [
    "print(3)  # 4",
    "print(3)  # 3.0",
    "print('3 4')  # 3",
    "print(3)\n# 3\n# 4",
    "for i in range(2):\n  print(i)\n# 0\n# 2",
    "print(0.2)  # 0.1...",
    "print('a')  # a b",
    "print(0.5)  # 0.5, 0.25",
    "if False:\n  print(1)  # 1",
  ],
)
def test_the_checker_catches_a_wrong_shown_value(code):
  (miss,) = run_block(code, {}, "wrong")
  assert "wrong, line 1" in miss, miss


def test_a_blank_line_ends_what_a_comment_shows():
  code = "print(1)\n\nprint(2)  # 2\nprint(3)\n\n# prose about what follows\nx = 1\n"
  assert run_block(code, {}, "blank") == []
