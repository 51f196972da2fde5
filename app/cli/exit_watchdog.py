"""The last resort of a shutdown: a small watchdog process ends `kvforge serve` with SIGKILL when it is still running
`deadline_s` after a SIGTERM or SIGINT, whatever its threads are doing.

Why a process, told by faulthandler: a thread that holds the interpreter (a long computation inside a C extension)
keeps every other thread from running, the Python-level signal handler included, so nothing inside the server can
act on the signal. faulthandler's handler is C: it writes the receiving thread's traceback to a pipe without
needing the interpreter, and the watchdog, reading that pipe, acts from outside. The graceful path (serve.py) ends
well before the deadline; then the watchdog sees the server gone and exits too. Linux only (pidfd); elsewhere there
is no watchdog.
"""

from __future__ import annotations

import faulthandler
import os
import signal
import subprocess
import sys

# The watchdog's own code: stdin is the pipe's read end. It forks at once and its first process exits, so that it is
# no child of the server's (whose children are its tensor-parallel ranks and workers); in a session of its own, it
# ignores SIGINT / SIGTERM and ends by itself when the server does.
WATCHDOG = """
import os, select, signal, sys
if os.fork():
    os._exit(0)
pid, deadline = int(sys.argv[2]), float(sys.argv[3])
for sig in (signal.SIGINT, signal.SIGTERM):
    signal.signal(sig, signal.SIG_IGN)
server = os.pidfd_open(pid)
ready, _, _ = select.select([0, server], [], [])
if server in ready or not os.read(0, 65536):
    sys.exit(0)
ready, _, _ = select.select([server], [], [], deadline)
if not ready:
    sys.stderr.write(f"kvforge: error: still running {deadline:g} s after the signal to stop (a thread does not let "
                     "go): killed\\n")
    sys.stderr.flush()
    signal.pidfd_send_signal(server, signal.SIGKILL)
"""


class ExitWatchdog:
    """Started before serving; `arm()` once the server's own signal handlers are installed (faulthandler's runs
    first, then chains to them)."""

    def __init__(self, deadline_s: float) -> None:
        self.deadline_s = deadline_s
        self._pipe = None
        if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
            return
        read_end, write_end = os.pipe()
        try:
            subprocess.run([sys.executable, "-I", "-S", "-c", WATCHDOG, "kvforge-exit-watchdog", str(os.getpid()),
                            str(deadline_s)], stdin=read_end, stdout=subprocess.DEVNULL, start_new_session=True,
                           check=True, timeout=30)  # returns when the watchdog has forked off
        except (OSError, subprocess.SubprocessError) as exc:
            os.close(write_end)
            print(f"kvforge: warning: no exit watchdog ({exc})", file=sys.stderr, flush=True)
            return
        finally:
            os.close(read_end)
        self._pipe = os.fdopen(write_end, "wb", buffering=0)

    def arm(self) -> None:
        """From now on a SIGTERM or SIGINT starts the countdown (and the server's handler runs as before)."""
        if self._pipe is None:
            return
        for sig in (signal.SIGTERM, signal.SIGINT):
            faulthandler.register(sig, file=self._pipe, all_threads=False, chain=True)
