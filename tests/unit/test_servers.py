"""``servers.die_with_parent``: a started server does not outlive the process that started it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from trainyard import servers

pytestmark = pytest.mark.skipif(servers._PRCTL is None, reason="PR_SET_PDEATHSIG is Linux's")

_STARTER = """
import subprocess, sys, time
from trainyard.servers import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=die_with_parent())
print(child.pid, flush=True)
time.sleep(120)
"""


def _gone(pid: int, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie (exited, not yet reaped by its new parent) counts as gone
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def test_a_child_ends_when_the_process_that_started_it_is_killed_outright():
    starter = subprocess.Popen([sys.executable, "-c", _STARTER], stdout=subprocess.PIPE, text=True)
    try:
        child = int(starter.stdout.readline())
        assert not _gone(child, within=0.5)  # running while its parent lives
        starter.send_signal(signal.SIGKILL)
        starter.wait()
        assert _gone(child, within=10)
    finally:
        starter.kill()
        starter.wait()


def test_a_child_orphaned_before_it_could_ask_for_the_signal_ends_at_once():
    """The race: the parent died between the fork and the prctl (simulated: the child expects another parent)."""
    started = time.monotonic()
    no_such_parent = -1  # no process has it (1 would be pytest's own pid in some containers)
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=servers.die_with_parent(no_such_parent)
    )
    assert child.wait(timeout=30) == 128 + signal.SIGTERM
    assert time.monotonic() - started < 30
