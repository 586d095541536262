"""A replica group process's start-up (``python -m trainyard.training.replica``), in a fresh interpreter."""

from __future__ import annotations

import json
import os
import subprocess
import sys

SCRIPT = """
import gc, json, sys
import trainyard.training.replica as replica
replica.wait_for_plan = lambda *_: False  # no plan comes: main returns once start-up is done
code = replica.main(["--job-dir", sys.argv[1], "--replica", "0"])
print(json.dumps({"code": code, "enabled": gc.isenabled(), "frozen": gc.get_freeze_count()}))
"""


def test_start_up_imports_without_collections_and_leaves_the_collector_on(tmp_path):
    env = {**os.environ, "TRAINYARD_CARBON_METER": "off"}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env
    )
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["code"] == 3  # no plan: the group says so and exits
    assert "the plan never came" in json.loads((tmp_path / "replicas/0/attempt-0/error.json").read_text())["message"]
    # What the imports made (torch, torchft, the engine) is out of every later collection's walk, and
    # the collector runs again for what training allocates.
    assert result["enabled"] is True
    assert result["frozen"] > 100_000
