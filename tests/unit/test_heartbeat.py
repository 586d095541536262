"""A replica group's heartbeat: beats while the group does slow work of its own, and none after."""

from __future__ import annotations

import json
import time

from trainyard.training.attempt_files import Heartbeat


def _read(path):
    return json.loads(path.read_text())


def test_slow_work_keeps_beating_and_no_beat_of_it_follows_the_next_step(tmp_path):
    path = tmp_path / "heartbeat.json"
    heartbeat = Heartbeat(path, busy_every=0.1)
    heartbeat.beat(3, force=True)
    watchers = []
    for _ in range(2):  # one watcher serves each slow work in turn
        started = time.time()
        beats = []
        with heartbeat.while_busy(3):
            watchers.append(heartbeat._watcher)
            while time.time() - started < 0.6:  # work that waits on nothing the loop would beat at
                beats.append(_read(path)["unix"])
                time.sleep(0.02)
        assert len({b for b in beats if b > started}) >= 2  # beats while busy, not only at the end
    assert watchers[0] is watchers[1]
    heartbeat.beat(4, force=True)
    time.sleep(0.3)  # past busy_every: a watcher still beating step 3 would have written by now
    assert _read(path)["step"] == 4
    heartbeat.close()
    heartbeat._watcher.join(timeout=2)
    assert not heartbeat._watcher.is_alive()


def test_quick_work_at_a_new_step_leaves_that_step(tmp_path):
    path = tmp_path / "heartbeat.json"
    heartbeat = Heartbeat(path)
    heartbeat.beat(7, force=True)
    with heartbeat.while_busy(8):  # an epoch's end, moments after the loop's last beat
        pass
    assert _read(path)["step"] == 8
    written = _read(path)["unix"]
    with heartbeat.while_busy(8):  # the same step again, just beaten: no second write
        pass
    assert _read(path)["unix"] == written
    heartbeat.close()


def test_a_wait_on_the_peers_keeps_beating_and_ends_without_a_write(tmp_path):
    # a step's quorum waiting for a peer's restart (or a heal's transfer) longer than the silence limit: the group
    # is alive, and beats; the loop's own beat at its next step follows, so leaving the wait writes nothing
    path = tmp_path / "heartbeat.json"
    heartbeat = Heartbeat(path, busy_every=0.1)
    heartbeat.beat(5, force=True)
    started = time.time()
    beats = []
    with heartbeat.while_busy(5, closing_beat=False):
        while time.time() - started < 0.6:
            beats.append(_read(path)["unix"])
            time.sleep(0.02)
    assert len({b for b in beats if b > started}) >= 2
    written = path.stat().st_mtime_ns
    with heartbeat.while_busy(6, closing_beat=False):  # a quick quorum at the next step
        pass
    assert path.stat().st_mtime_ns == written and _read(path)["step"] == 5
    heartbeat.close()
