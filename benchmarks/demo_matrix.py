"""Runs examples/demo.py over seeds and CPU instruction sets; checks its verdicts keep margin.

Each run is a process of its own under ``XLA_FLAGS=--xla_cpu_max_isa=...``;
the tables go to docs/demo_matrix.md, which says how the margin is judged.
``python benchmarks/demo_matrix.py --help`` shows the options and examples.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import shlex
import statistics
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
  sys.path.insert(0, str(ROOT))

from benchmarks.markdown import prose  # noqa: E402

TEMPLATE = pathlib.Path(__file__).with_name("demo_matrix_template.md")
DEMO = ROOT / "examples" / "demo.py"
ISAS = ("native", "SSE4_2", "AVX", "AVX2", "AVX512")
EPILOG = """Per row of the demo: its bound, its worst and mean validation-loss gap to
FP32 over the runs, and whether the worst case keeps half the bound as margin
(a row that must end within tolerance of FP32, above or below: every gap within
tolerance / 2 of 0; a row that must end more than worse_by above FP32: worst gap
>= 1.5 x worse_by).

examples:
  python benchmarks/demo_matrix.py                        # 5 seeds x 5 ISAs: about an hour
  python benchmarks/demo_matrix.py --seeds 0,1 --isas native,AVX2 --no-docs
  python benchmarks/demo_matrix.py --docs docs/demo_matrix.md   # the docs page (default)

Every run's record is kept in --records (default demo_results/matrix/) and
reused when present with the same demo arguments, so an interrupted matrix
resumes where it stopped; --fresh reruns everything. Arguments after -- go to
every demo run (for experiments: -- --lr 1e-3 --rows "bf16+mpx,bf16 no masters")."""


def cpu_model() -> str:
  """Returns the CPU's model name as ``lscpu`` prints it (Linux), else the platform's guess."""
  try:
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    for line in out.splitlines():
      key, _, value = line.partition(":")
      if key.strip() == "Model name":
        return value.strip()
  except (OSError, subprocess.CalledProcessError):
    pass
  return platform.processor() or platform.machine()


def demo_rows() -> dict:
  """Returns the demo's rows (``examples/demo.py``'s ``ROW_BY_NAME``), with their bounds."""
  sys.path.insert(0, str(DEMO.parent))
  import demo

  return demo.ROW_BY_NAME


def demo_settings(args: list[str]) -> dict:
  """Returns the settings (as in the demo's JSON record) ``examples/demo.py args`` runs."""
  import dataclasses

  sys.path.insert(0, str(DEMO.parent))
  import demo

  return json.loads(json.dumps(dataclasses.asdict(demo.parse_args(args)[0])))


def run_one(seed: int, isa: str, demo_args: list[str], records: pathlib.Path, fresh: bool) -> dict:
  """Runs the demo once (or reuses its kept record); returns its JSON record and exit status."""
  name = f"seed{seed}-{isa}.json"
  path = records / name
  args = ["--seed", str(seed), "--out", str(records / "plots" / f"{name}.png")]
  args += demo_args
  if path.exists() and not fresh:
    record = json.loads(path.read_text())
    # Kept only if made with the same arguments and the settings they mean now.
    if record.get("demo_args") == args and record["settings"] == demo_settings(args):
      return record
  env = dict(os.environ)
  env.pop("MPX_SMOKE", None)
  flags = env.get("XLA_FLAGS", "").split()
  flags = [f for f in flags if not f.startswith("--xla_cpu_max_isa")]
  if isa != "native":
    flags.append(f"--xla_cpu_max_isa={isa}")
  env["XLA_FLAGS"] = " ".join(flags)
  tmp = records / f".{name}"
  command = [sys.executable, str(DEMO), *args, "--json", str(tmp)]
  start = time.perf_counter()
  done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
  # Status 1: a check failed; the record says which (the table shows the gaps).
  if done.returncode not in (0, 1) or not tmp.exists():
    raise SystemExit(
      f"demo failed (seed {seed}, {isa}, status {done.returncode}):\n"
      f"{shlex.join(command)}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
  record = json.loads(tmp.read_text())
  record.update(demo_args=args, isa=isa, seed=seed, run_seconds=time.perf_counter() - start)
  path.write_text(json.dumps(record, indent=1) + "\n")
  tmp.unlink()
  return record


def summarize(records: list[dict]) -> tuple[list[dict], bool]:
  """Returns per row its bound, worst and mean gap, margin verdict; and whether all keep margin."""
  modes = [row["mode"] for row in max((r["rows"] for r in records), key=len)]
  summary, all_ok = [], True
  rows = demo_rows()
  for mode in modes[1:]:
    # A row can be missing from a run: the float16 one where XLA cannot compile float16.
    gaps = [r["gap"] for record in records for r in record["rows"] if r["mode"] == mode]
    bound = rows[mode]  # the demo's bounds now (the records hold those of their run)
    entry = dict(
      mode=mode,
      n=len(gaps),
      mean=statistics.fmean(gaps),
      sd=statistics.stdev(gaps) if len(gaps) > 1 else 0.0,
      lo=min(gaps),
      hi=max(gaps),
    )
    if bound.tolerance is not None:
      # Within the tolerance of FP32, above or below: the gap farthest from 0.
      tol = bound.tolerance
      worst = max(entry["lo"], entry["hi"], key=abs)
      entry.update(
        bound=f"within {tol:.1%}",
        worst=worst,
        ok=abs(worst) <= tol,
        margin=abs(worst) <= tol / 2,
        need=f"within {tol / 2:.2%}",
      )
    elif bound.worse_by is not None:
      gap = bound.worse_by
      entry.update(
        bound=f"> {gap:.1%}",
        worst=entry["lo"],
        ok=entry["lo"] > gap,
        margin=entry["lo"] >= 1.5 * gap,
        need=f">= {1.5 * gap:.2%}",
      )
    else:
      entry.update(bound="-", worst=entry["hi"], ok=True, margin=True, need="-")
    all_ok &= entry["margin"]
    summary.append(entry)
  return summary, all_ok


def table(records: list[dict], summary: list[dict]) -> list[str]:
  """Renders the summary as a Markdown table, then a per-run table of every gap."""
  lines = [
    "| row | bound | margin needs | worst | mean | sd | mean + 3 sd | range | ok | margin |",
    "|:--|--:|--:|--:|--:|--:|--:|--:|:-:|:-:|",
  ]
  for e in summary:
    lines.append(
      f"| {e['mode']} | {e['bound']} | {e['need']} | {e['worst']:+.2%} | {e['mean']:+.2%} | "
      f"{e['sd']:.2%} | {e['mean'] + 3 * e['sd']:+.2%} | {e['lo']:+.2%} to {e['hi']:+.2%} | "
      f"{'yes' if e['ok'] else 'NO'} | {'yes' if e['margin'] else 'NO'} |"
    )
  modes = [e["mode"] for e in summary]
  lines += [
    "",
    "| seed | ISA | fp32 val | " + " | ".join(modes) + " | checks | s |",
    "|--:|:--|--:|" + "--:|" * len(modes) + ":-:|--:|",
  ]
  for r in records:
    gaps = {row["mode"]: row["gap"] for row in r["rows"]}
    lines.append(
      f"| {r['seed']} | {r['isa']} | {r['rows'][0]['val_loss']:.4f} | "
      + " | ".join(f"{gaps[m]:+.2%}" if m in gaps else "-" for m in modes)
      + f" | {'OK' if r['ok'] else 'FAIL'} | {r['seconds']:.0f} |"
    )
  return lines


def write_docs(path: pathlib.Path, lines: list[str], records: list[dict], command: str) -> None:
  """Writes docs/demo_matrix.md: how the matrix ran, then ``lines``, the tables."""
  settings = records[0]["settings"]
  m, o = settings["model"], settings["opt"]
  seeds = sorted({r["seed"] for r in records})
  isas = [isa for isa in ISAS if any(r["isa"] == isa for r in records)]
  seconds = [r["seconds"] for r in records]
  demo_args = records[0]["demo_args"]
  extra = demo_args[demo_args.index("--out") + 2 :]
  extra = f"with `{shlex.join(extra)}`" if extra else "at its defaults"
  short = any(len(r["rows"]) < max(len(x["rows"]) for x in records) for r in records)
  page = prose(
    "page",
    template=TEMPLATE,
    command=command,
    cpu=cpu_model(),
    cores=os.cpu_count(),
    machine=records[0]["machine"],
    seeds=", ".join(map(str, seeds)),
    isas=", ".join(isas),
    runs=len(records),
    extra=extra,
    layers=m["layers"],
    width=m["width"],
    context=m["context"],
    steps=o["steps"],
    peak_lr=o["peak_lr"],
    weight_decay=o["weight_decay"],
    batch=settings["batch"],
    eval_windows=settings["eval_windows"],
    fastest=min(seconds),
    slowest=max(seconds),
    sse4_2=prose("sse4_2", template=TEMPLATE) + "\n" if short else "",
  )
  path.write_text("\n".join([page, "", *lines, ""]))


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  demo_args: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, demo_args = argv[:i], argv[i + 1 :]
  parser = argparse.ArgumentParser(
    description=__doc__.split("\n\n")[0],
    epilog=EPILOG,
    formatter_class=argparse.RawDescriptionHelpFormatter,
  )
  parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated (0,1,2,3,4)")
  parser.add_argument(
    "--isas", default=",".join(ISAS), help=f"comma-separated, of {', '.join(ISAS)} (all)"
  )
  parser.add_argument("--records", type=pathlib.Path, default=ROOT / "demo_results" / "matrix")
  parser.add_argument("--fresh", action="store_true", help="rerun even where a record exists")
  parser.add_argument(
    "--docs",
    type=pathlib.Path,
    default=ROOT / "docs" / "demo_matrix.md",
    help="write the table to this page (docs/demo_matrix.md)",
  )
  parser.add_argument("--no-docs", action="store_true", help="print only")
  args = parser.parse_args(argv)
  seeds = [int(s) for s in args.seeds.split(",")]
  isas = [s.strip() for s in args.isas.split(",")]
  if set(isas) - set(ISAS):
    parser.error(f"--isas: one of {', '.join(ISAS)}")
  args.records.mkdir(parents=True, exist_ok=True)
  records = []
  for seed in seeds:
    for isa in isas:
      record = run_one(seed, isa, demo_args, args.records, args.fresh)
      records.append(record)
      gaps = " ".join(f"{r['mode']} {r['gap']:+.2%}" for r in record["rows"][1:])
      print(f"seed {seed} {isa:<7} {record['seconds']:4.0f} s  {gaps}", flush=True)
  summary, ok = summarize(records)
  lines = table(records, summary)
  verdict = "every row keeps half its bound as margin" if ok else "some row lacks margin"
  print("\n".join(lines) + f"\n\n{verdict}")
  if not args.no_docs:
    command = shlex.join(["python", "benchmarks/demo_matrix.py", *sys.argv[1:]])
    write_docs(args.docs, [*lines, "", f"Verdict: {verdict}."], records, command)
    print(f"wrote {args.docs}")
  return 0 if ok else 1


if __name__ == "__main__":
  sys.exit(main())
