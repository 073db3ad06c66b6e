"""Reading the tables the example scripts print."""


def table_rows(stdout: str, modes) -> dict[str, list[str]]:
  """The table's rows keyed by mode name, each split into its other cells."""
  rows = {}
  for line in stdout.splitlines():
    for mode in modes:
      if line.startswith(mode + " "):
        rows[mode] = line[len(mode) :].split()
  return rows
