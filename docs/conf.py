"""Sphinx configuration: MyST Markdown pages plus an API reference from docstrings.

Build with warnings as errors (as CI does):
  sphinx-build -W --keep-going -b html docs docs/_build/html
"""

import mpx

project = "mpx"
author = "The mpx authors"
copyright = "2026, The mpx authors"
release = mpx.__version__

extensions = [
  "myst_parser",
  "sphinx.ext.autodoc",
  "sphinx.ext.napoleon",
  "sphinx.ext.viewcode",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
myst_heading_anchors = 3

# Google-style docstrings; keep signatures readable.
napoleon_google_docstring = True
napoleon_numpy_docstring = False
autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_default_options = {"members": False}

html_theme = "furo"
html_title = f"mpx {release}"
