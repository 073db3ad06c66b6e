"""Two processes on localhost, one global mesh: every process ends identical.

Starts tests/multiprocess_worker.py twice (``jax.distributed.initialize`` with
a localhost coordinator, CPU collectives over gloo, 2 CPU devices per process)
and compares what the two report: parameters, float32 masters, loss-scale
history and skip counts, across a step that overflows in the last process's
batch shard only, for replicated and ZeRO-1-sharded optimizer state, and for a
shard_map step with ``axis_name``.
"""

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Slow: two processes that each start jax (most of the test's time), a
# release's check of the multi-host setup; -m multiprocess runs it alone.
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

WORKER = Path(__file__).with_name("multiprocess_worker.py")
NUM_PROCESSES = 2
DEVICES_PER_PROCESS = 2
TIMEOUT_S = 90
PORT_ATTEMPTS = 3
# Messages that mean the coordinator could not have its port, not a real failure.
PORT_ERRORS = ("address already in use", "failed to add port", "failed to start rpc server")


def free_port() -> int:
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def launch(port: int) -> list[tuple[int, str, str]]:
  """Runs the workers; returns (returncode, stdout, stderr) per process.

  Output goes to temporary files (a full pipe could block a worker). Once a
  worker fails, the others are stopped at once instead of left to time out
  waiting for it.
  """
  env = dict(
    os.environ,
    JAX_PLATFORMS="cpu",
    XLA_FLAGS=f"--xla_force_host_platform_device_count={DEVICES_PER_PROCESS}",
  )
  with contextlib.ExitStack() as stack:
    files = [
      (
        stack.enter_context(tempfile.TemporaryFile("w+")),
        stack.enter_context(tempfile.TemporaryFile("w+")),
      )
      for _ in range(NUM_PROCESSES)
    ]
    procs = [
      subprocess.Popen(
        [sys.executable, str(WORKER), f"127.0.0.1:{port}", str(NUM_PROCESSES), str(i)],
        env=env,
        stdout=out,
        stderr=err,
        text=True,
      )
      for i, (out, err) in enumerate(files)
    ]
    deadline = time.monotonic() + TIMEOUT_S
    timed_out = True
    while time.monotonic() < deadline:
      codes = [proc.poll() for proc in procs]
      if all(code is not None for code in codes) or any(code for code in codes):
        timed_out = False
        break
      time.sleep(0.1)
    for proc in procs:
      if proc.poll() is None:
        proc.kill()
      proc.wait()
    outputs = []
    for proc, (out, err) in zip(procs, files, strict=True):
      out.seek(0)
      err.seek(0)
      note = f"\n[test] stopped after {TIMEOUT_S} s" if timed_out else ""
      outputs.append((proc.returncode, out.read(), err.read() + note))
  return outputs


def run_workers() -> list[dict]:
  for attempt in range(PORT_ATTEMPTS):
    outputs = launch(free_port())
    if all(code == 0 for code, _, _ in outputs):
      break
    errors = " ".join(err.lower() for _, _, err in outputs)
    if attempt + 1 < PORT_ATTEMPTS and any(m in errors for m in PORT_ERRORS):
      continue  # another program took the port between free_port() and bind
    report = "\n".join(
      f"--- process {i} exited {code}\n{err[-3000:]}" for i, (code, _, err) in enumerate(outputs)
    )
    pytest.fail(f"worker processes failed:\n{report}")
  results = []
  for _, out, _ in outputs:
    lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, out[-3000:]
    results.append(json.loads(lines[0].removeprefix("RESULT ")))
  return results


def test_two_processes_train_identically_across_an_overflow():
  results = run_workers()
  assert [r["process_id"] for r in results] == list(range(NUM_PROCESSES))
  total = NUM_PROCESSES * DEVICES_PER_PROCESS
  assert all(r["devices"] == total for r in results)
  first, second = results

  for mode in ("replicated", "zero1"):
    a, b = first[mode], second[mode]
    for key in ("params", "masters", "scales", "skipped"):
      assert a[key] == b[key], (mode, key, a[key], b[key])
    # Step 2 overflowed in the last process's shard only; every process
    # skipped it and backed off together. Growth every 2 finite steps.
    assert a["skipped"] == 1
    assert a["scales"] == [2.0**10, 2.0**11, 2.0**10, 2.0**10, 2.0**11]

  # ZeRO-1 sharded the masters over all devices of both processes and still
  # trained bit for bit like the replicated state.
  assert first["replicated"]["master_w_shard_rows"] == 4
  assert first["zero1"]["master_w_shard_rows"] == 4 // total
  for key in ("params", "masters"):
    assert first["zero1"][key] == first["replicated"][key], key

  # shard_map with axis_name: one device of the last process saw an inf; all
  # devices of both processes skipped and agree on the scale.
  for r in results:
    assert r["shard_map"]["scales"] == [4.0] * total
    assert r["shard_map"]["skipped"] == [1] * total
  assert first["shard_map"]["params"] == second["shard_map"]["params"]
