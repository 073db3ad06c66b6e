"""Claims of docs/guarantees.md and docs/comparison.md, each tried as written.

The first test keeps the docs honest about tests: every test they name must
be one pytest collects. The others try single sentences of the two pages.
"""

import ast
import fnmatch
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import optax

import mpx

ROOT = pathlib.Path(__file__).resolve().parent.parent
PAGES = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
# `tests/test_x.py::test_name[params]`, a bare `tests/...py`, or a bare
# `test_name`, `test_b1_*`, `test_name[a|b]` in backticks.
PATH_REF = re.compile(r"tests/([\w/]+\.py)(?:::(\w+))?")
NAME_REF = re.compile(r"`(test_\w*\*?)(?:\[[^\]`]*\])?`")


def collected_tests() -> dict[str, set[str]]:
  """The test functions pytest collects (module level, or in a `Test*`
  class), by file, read with ast: no import, no subprocess."""
  found = {}
  for path in sorted((ROOT / "tests").glob("test_*.py")):
    names = set()
    for node in ast.parse(path.read_text()).body:
      bodies = [node]
      if isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
        bodies = node.body
      names |= {
        f.name
        for f in bodies
        if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef) and f.name.startswith("test")
      }
    found[path.name] = names
  return found


def doc_references():
  """(page, line number, file or None, test name or None) for every
  reference to a test in the docs."""
  for page in PAGES:
    for number, line in enumerate(page.read_text().splitlines(), 1):
      for match in PATH_REF.finditer(line):
        yield page.name, number, match.group(1), match.group(2)
      for match in NAME_REF.finditer(line):
        if not line[: match.start()].endswith("::"):
          yield page.name, number, None, match.group(1)


def test_every_test_the_docs_name_is_collected_by_pytest():
  tests = collected_tests()
  everywhere = set().union(*tests.values())
  missing = []
  seen = 0
  for page, number, file, name in doc_references():
    seen += 1
    where = f"{page}:{number}"
    if file is not None and not (ROOT / "tests" / file).is_file():
      missing.append(f"{where}: tests/{file} does not exist")
    elif name is None:
      continue
    elif file is not None and name not in tests.get(file, set()):
      missing.append(f"{where}: pytest collects no {name} in tests/{file}")
    elif file is None and not fnmatch.filter(everywhere, name):
      missing.append(f"{where}: pytest collects no test named {name} in tests/")
  assert seen > 100, f"only {seen} references found: has the docs' citation style changed?"
  assert not missing, "\n".join(missing)


def test_the_name_check_catches_a_test_that_does_not_exist():
  tests = collected_tests()
  assert not fnmatch.filter(set().union(*tests.values()), "test_growth_never_produces_inf")
  assert "test_hand_computed_sequence" in tests["test_loss_scale.py"]
  line = "`tests/test_loss_scale.py::test_hand_computed_sequence` and `test_b1_*`, `test_x[a|b]`"
  assert [m.groups() for m in PATH_REF.finditer(line)] == [
    ("test_loss_scale.py", "test_hand_computed_sequence")
  ]
  assert [m.group(1) for m in NAME_REF.finditer(line)] == ["test_b1_*", "test_x"]


# --- guarantees.md: a leaf without a master ----------------------------------


def test_a_scale_below_one_can_overflow_a_finite_gradient_of_a_leaf_without_a_master():
  """Unscaling divides by the scale: below 1 it multiplies, and a finite
  float32 gradient near the float32 maximum becomes inf. The step is skipped,
  as every step whose gradient is non-finite as the inner rule receives it."""
  params = {"w": jnp.zeros(2, jnp.float32)}
  grads = {"w": jnp.array([3e38, 1.0], jnp.float32)}
  tx = mpx.static_loss_scale(optax.sgd(1.0), 0.5)
  updates, state = tx.update(grads, tx.init(params), params)
  assert int(state.skipped_steps) == 1 and not np.any(np.asarray(updates["w"]))
  # With a scale of at least 1 (loss_scale's default min_scale is 1), never.
  for tx in [mpx.static_loss_scale(optax.sgd(1.0), 1.0), mpx.loss_scale(optax.sgd(1.0))]:
    updates, state = tx.update(grads, tx.init(params), params)
    assert int(state.skipped_steps) == 0 and np.isfinite(np.asarray(updates["w"])).all()
  tx = mpx.mixed_precision(optax.sgd(1.0))
  updates, state = tx.update(grads, tx.init(params), params)
  assert int(state.nonfinite_steps) == 0


# --- comparison.md: flax's DynamicScale, read from flax 0.12.8 -----------------


def test_flax_dynamic_scale_skips_only_the_first_step_of_a_float16_loss():
  """flax/training/dynamic_scale.py: the scale starts at 65536.0, a Python
  float, so `scale * loss` stays float16 and the seed of the backward pass is
  inf. The first step's gradients are not finite, the scale halves to 32768,
  which float16 holds, and the next steps are finite. A float32 loss (here,
  of the same float16 params) takes the seed in float32."""
  from flax.training.dynamic_scale import DynamicScale

  params = {"w": jnp.full(3, 0.01, jnp.float16)}
  losses = {
    "float16": lambda p: jnp.sum(p["w"] * p["w"]),
    "float32": lambda p: jnp.sum(p["w"].astype(jnp.float32) ** 2),
  }
  flags = {}
  for name, loss_fn in losses.items():
    scale, flags[name] = DynamicScale(), []
    for _ in range(4):
      scale, finite, _, _ = scale.value_and_grad(loss_fn)(params)
      flags[name].append(bool(finite))
  assert flags == {"float16": [False, True, True, True], "float32": [True] * 4}
  assert float(scale.scale) == 65536.0


# --- every page: a list of modes names every mode of the code ----------------
#
# A list of the `masters=` modes or the `moments=` formats that a page keeps is
# marked by `<!-- modes: masters -->`, `<!-- modes: moments -->` or both
# (`<!-- modes: masters moments -->`) on the line before it; the list is what
# follows up to the next blank line outside a code block (a table, a list, a
# paragraph or a snippet). Unmarked paragraphs (not table rows) that name
# three or more masters modes, or both "bfloat16" and "8bit" moments, in
# quotes, are lists too. Each must name
# every mode the code has, so that a new mode cannot leave a page stale.

MODES_MARK = re.compile(r"<!-- modes: ([a-z ]+) -->")


def mode_names() -> dict[str, tuple[str, ...]]:
  from mpx._src import moments, storage

  return {"masters": tuple(storage.MODES), "moments": tuple(moments.FORMATS)}


def spellings(mode: str) -> tuple[str, ...]:
  """How prose may name a mode: `"4bit"`, 4bit, 4-bit."""
  return (mode, mode.replace("bit", "-bit")) if mode[0].isdigit() else (mode,)


def names(text: str, mode: str) -> bool:
  return any(re.search(rf"(?<![\w-]){re.escape(s)}(?![\w-])", text) for s in spellings(mode))


def blocks_after_marks(text: str):
  """(line number, kinds, block) for each mark: the lines after it up to the
  first blank line outside a code fence."""
  lines = text.splitlines()
  for number, line in enumerate(lines):
    mark = MODES_MARK.search(line)
    if not mark:
      continue
    block, fenced = [], False
    for following in lines[number + 1 :]:
      if following.startswith("```"):
        fenced = not fenced
      if not following.strip() and not fenced:
        break
      block.append(following)
    yield number + 1, mark.group(1).split(), "\n".join(block)


def paragraphs(text: str):
  """(line number, paragraph) outside code fences, and whether a mark precedes it."""
  start, lines, fenced, marked = 0, [], False, False
  for number, line in enumerate([*text.splitlines(), ""], 1):
    if line.startswith("```"):
      fenced = not fenced
      continue
    if fenced:
      continue
    if not line.strip():
      if lines:
        yield start, "\n".join(lines), marked
      lines, marked = [], False
      continue
    if MODES_MARK.search(line):
      marked = True
      continue
    if line.startswith("|"):  # a table row: a list only where marked
      continue
    if not lines:
      start = number
    lines.append(line)


def stale_mode_lists(text: str, page: str) -> list[str]:
  modes, stale = mode_names(), []
  for number, kinds, block in blocks_after_marks(text):
    for kind in kinds:
      assert kind in modes, f"{page}:{number}: unknown mark {kind!r}"
      missing = [m for m in modes[kind] if not names(block, m)]
      if not block.strip() or missing:
        left_out = missing or "everything"
        stale.append(f"{page}:{number}: the marked {kind} list leaves out {left_out}")
  quoted = lambda mode, p: f'"{mode}"' in p  # noqa: E731
  for number, paragraph, marked in paragraphs(text):
    if marked:
      continue
    masters = [m for m in modes["masters"] if quoted(m, paragraph)]
    if len(masters) >= 3 and len(masters) < len(modes["masters"]):
      stale.append(f"{page}:{number}: names the masters modes {masters}, not all: complete it")
    formats = [m for m in modes["moments"] if m != "full" and quoted(m, paragraph)]
    if {"bfloat16", "8bit"} <= set(formats) and len(formats) < len(modes["moments"]) - 1:
      stale.append(f"{page}:{number}: names the moments {formats}, not all: complete it")
  return stale


def test_every_list_of_modes_in_the_docs_names_every_mode_of_the_code():
  stale, marks = [], 0
  for page in PAGES:
    text = page.read_text()
    marks += len(MODES_MARK.findall(text))
    stale += stale_mode_lists(text, page.name)
  assert marks >= 9, f"only {marks} marked mode lists: has the marking changed?"
  assert not stale, "\n".join(stale)


def test_the_mode_list_check_catches_a_list_without_the_newest_mode():
  page = 'Modes:\n\n<!-- modes: masters -->\n- `"full"`, `"remainder"` and `"stochastic"`\n'
  assert stale_mode_lists(page, "p") == ["p:3: the marked masters list leaves out ['24bit']"]
  unmarked = (
    'Store them `"full"`, as `"remainder"` or `"stochastic"`.\n\n'
    'The `"bfloat16"` or `"8bit"` moments.'
  )
  assert len(stale_mode_lists(unmarked, "p")) == 2
  whole = (
    "<!-- modes: masters moments -->\n```python\n"
    'for m in ("full", "remainder", "24bit", "stochastic"):\n\n'
    '  x = ("bfloat16", "8bit", "4-bit")\n```\n'
  )
  assert stale_mode_lists(whole, "p") == []
