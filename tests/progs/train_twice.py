"""``train()`` twice in one process, the first run stopped by SIGUSR1 (issue #13).

Prints, on rank 0, one JSON line: whether each run was preempted and which handlers are
installed afterwards. The second run must start unsignalled, and Ctrl-C must work after.
"""

import json
import os
import signal
import sys
import threading
import time

from mpi4py import MPI

from geompi.config import make_config
from geompi.train import train

args = sys.argv[1:]
rank = MPI.COMM_WORLD.Get_rank()


def signal_once_training() -> None:
    """SIGUSR1 to this process a moment after the first run installed its handler (a fixed
    delay from start-up, as before, waited 12 s to be safe on a loaded machine, and the first
    run trained all that time)."""
    while signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL:
        time.sleep(0.02)
    time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGUSR1)


# rank 0 (a worker) is signalled during the first run; the workers agree on the stop and tell
# the servers (signalling every rank by its own timer would hit a later one after the run)
if rank == 0:
    threading.Thread(target=signal_once_training, daemon=True).start()
first = train(make_config([*args, "--steps", "100000"], env={}))
second = train(make_config([*args, "--steps", "6"], env={}))
if rank == 0:
    out = {
        "first_preempted": first["preempted"],
        "second_preempted": second["preempted"],
        "second_steps": second["steps"],
        "sigint_default": signal.getsignal(signal.SIGINT) is signal.default_int_handler,
        "sigusr1_default": signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL,
        "sigterm_default": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
    }
    print(json.dumps(out), flush=True)
