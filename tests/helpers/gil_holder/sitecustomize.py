"""On the PYTHONPATH of a `kvforge serve` a test starts (tests/e2e/test_restart.py): a thread that, once the file
named by KVFORGE_TEST_HOLD_GIL_FILE exists, holds the interpreter for good — one long call into C that never lets
it go, as a request running a long native computation did (a chat template's `**` on huge numbers, before templates
were rendered in a worker process). Test-only: no kvforge code reads the variable; Python imports this module at
start-up because it is named sitecustomize."""

import itertools
import os
import sys
import threading
import time

TRIGGER = os.environ.get("KVFORGE_TEST_HOLD_GIL_FILE")


def hold() -> None:
    while not os.path.exists(TRIGGER):
        time.sleep(0.05)
    if "serve" in sys.argv:  # the server only, not a process it starts
        sum(itertools.repeat(1, 10**13))  # a C loop: the interpreter is never released


if TRIGGER:
    threading.Thread(target=hold, name="test-gil-holder", daemon=True).start()
