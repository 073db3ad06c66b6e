"""mpx benchmarks: optimizer step, whole training step, compile time, host syncs.

Run ``python benchmarks/run.py`` from the repository root (``--smoke`` for a
tiny, seconds-long run); see ``docs/benchmarks.md`` for the results.
"""
