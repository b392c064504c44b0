"""bm.reaper: what a SIGKILLed driver started does not outlive it (Ray's node agents did, under PID 1)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bm.reaper import TOKEN_ENV, marked
from tests.conftest import REPO
from tests.hang import HANG_S

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")

# A driver that starts the watcher, then an orphan-to-be: a process in a session of its own (as Ray's
# agents are), which nothing but the watcher would ever end once the driver is killed.
DRIVER = (
    "import os, subprocess, sys, time\n"
    "from bm.reaper import watch, TOKEN_ENV\n"
    "watch()\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(100000)'], start_new_session=True)\n"
    "print(child.pid, os.environ[TOKEN_ENV], flush=True)\n"
    "time.sleep(100000)\n"
)


def test_what_a_sigkilled_driver_started_is_killed_after_the_grace_period():
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, cwd=REPO)
    pid, token = driver.stdout.readline().split()
    orphan = int(pid)
    assert marked(token) == [orphan]  # the mark is inherited; the watcher itself does not carry it
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    assert orphan in marked(token)  # the driver's death alone does not end it
    waited = 0.0
    while marked(token) and waited < HANG_S:  # the watcher's work, after its grace period
        time.sleep(0.1)
        waited += 0.1
    assert marked(token) == [], "the orphan outlived the watcher"


def test_only_processes_carrying_the_token_are_marked():
    token = f"test-{os.getpid()}"
    env = {**os.environ, TOKEN_ENV: token}
    inside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], env=env)
    outside = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert marked(token) == [inside.pid]
    finally:
        inside.kill()
        outside.kill()
        inside.wait()
        outside.wait()
