"""Declares the options the step-timing benchmarks share, their defaults, and the progress log."""

from __future__ import annotations

import argparse
import re
import sys
import time
from typing import Any

import jax

DEFAULT_ROUNDS = 11
# Above this many params a round of every variant takes ~10 s on a 2-core CPU:
# fewer rounds keep the default run near twelve minutes.
LARGE_PARAMS = 48 * 2**20
DEFAULT_ROUNDS_LARGE = 7


def parse_size(text: str) -> int:
  """Parses a param count: ``"64M"`` -> 64 * 2**20, ``"64K"`` -> 64 * 2**10, ``"1000"`` -> 1000."""
  match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", text)
  if not match:
    raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 16M, 64K, 5000)")
  value = float(match.group(1)) * {"": 1, "k": 2**10, "m": 2**20}[match.group(2).lower()]
  return int(value)


def add_timing_options(
  parser: argparse.ArgumentParser,
  default_sizes: str,
  *,
  smoke_help: str,
  steps_help: str,
  window_help: str,
) -> None:
  """Adds the options every step-timing benchmark takes: ``--smoke``, ``--sizes``,
  ``--layers``, ``--rounds``, ``--steps`` and ``--window``; defaults filled in
  by :func:`resolve_timing_options`."""
  parser.add_argument("--smoke", action="store_true", help=smoke_help)
  parser.add_argument("--sizes", help=f"comma-separated param counts (default {default_sizes})")
  parser.add_argument("--layers", type=int, help="blocks in the benchmark tree (default 4)")
  parser.add_argument(
    "--rounds",
    type=int,
    help=f"timing rounds (default {DEFAULT_ROUNDS}; {DEFAULT_ROUNDS_LARGE} from "
    f"{LARGE_PARAMS // 2**20}M params; 2 with --smoke)",
  )
  parser.add_argument("--steps", type=int, help=f"{steps_help} (default 2; 1 with --smoke)")
  parser.add_argument("--window", type=float, help=window_help)


def resolve_timing_options(args: argparse.Namespace, default_sizes: str, smoke_sizes: str) -> None:
  """Fills in the defaults of :func:`add_timing_options`' options, smaller
  under ``--smoke``; ``--sizes`` becomes a list of param counts."""
  smoke = args.smoke
  args.sizes = [
    parse_size(s) for s in (args.sizes or (smoke_sizes if smoke else default_sizes)).split(",")
  ]
  args.layers = args.layers or (1 if smoke else 4)
  if smoke and args.rounds is None:
    args.rounds = 2
  args.steps = args.steps or (1 if smoke else 2)
  args.window = args.window if args.window is not None else (0.0 if smoke else 0.1)


def rounds_for(args: argparse.Namespace, n: int) -> int:
  """Returns the timing rounds on a tree of ``n`` params."""
  if args.rounds:
    return args.rounds
  return DEFAULT_ROUNDS_LARGE if n >= LARGE_PARAMS else DEFAULT_ROUNDS


def describe_tree(shapes: Any) -> str:
  """Describes a benchmark tree in one line: width, blocks and leaves."""
  if "ln_f" not in shapes:  # opt_bench.many_leaf_shapes
    leaves = jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple))
    rows, cols = leaves[0]
    return f"{len(leaves)} leaves of {rows}x{cols} in {len(shapes)} blocks"
  d = shapes["ln_f"]["scale"][0]
  vocab = shapes["embed"]["embedding"][0]
  blocks = sum(k.startswith("block_") for k in shapes)
  leaves = len(jax.tree.leaves(shapes, is_leaf=lambda x: isinstance(x, tuple)))
  return f"width {d}, {blocks} blocks, embedding {vocab}x{d}, {leaves} leaves"


_START = time.perf_counter()


def log(message: str) -> None:
  """Prints progress on stderr, with the seconds since the run started."""
  print(f"[{time.perf_counter() - _START:6.1f} s] {message}", file=sys.stderr, flush=True)
