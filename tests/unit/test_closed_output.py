"""A flow run whose worker shut down: the pipe its output went to is closed. It goes on, writing nowhere, and does
not exit on the next line Prefect's console handler logs (rich's answer to a closed pipe)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import logging, sys, time
from prefect.logging.handlers import PrefectConsoleHandler
from trainyard import progress
if sys.argv[2] == "outlive":
    progress.outlive_closed_output()
log = logging.getLogger("run")
log.addHandler(PrefectConsoleHandler(stream=sys.stderr))
time.sleep(1.0)  # the reader closes its end meanwhile
for i in range(200):
    log.warning("epoch %d: %s", i, "x" * 200)
print("and a print", flush=True)
open(sys.argv[1], "w").write("went on")
"""


@pytest.mark.parametrize("outlive", [True, False])
def test_a_run_whose_output_pipe_closes_goes_on_writing_nowhere(tmp_path, outlive):
    marker = tmp_path / "alive"
    child = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(marker), "outlive" if outlive else "as-rich-does"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=Path(__file__).parents[2],
        env={**os.environ, "PREFECT_LOGGING_COLORS": "false"},
    )
    child.stdout.close()
    child.stderr.close()  # the worker that streamed the run's output is gone
    code = child.wait(timeout=120)
    if outlive:
        assert (code, marker.read_text()) == (0, "went on")
    else:  # what it guards against: rich exits the process from inside a log call
        assert code != 0 and not marker.exists()
