"""Several ``geompi.train`` runs in one mpirun job across network namespaces (tests/netns.py),
each under its own kernel shaping, with the kernel's byte counters around each.

Usage: ``python tests/netns.py ... -- python netns_runs.py OUT SPEC`` (or ``Cluster.run``),
SPEC a JSON list of ``{"args": [...], "env": {...}, "rate": bits/s or null}``. Before run i,
rank 0 sets every shaped link to ``rate`` (tc tbf; null: unshaped) and reads the counters of
every host's veth; after it (all ranks done) it reads them again and writes
``OUT/run{i}.net.json``: ``{"rate", "wall_s", "before", "after"}`` (``wall_s``: the whole run,
start-up and end included). Each rank's output goes to ``OUT/run{i}.rank{r}.{out,err,rc}`` as in
train_runs.py. Every rank's hostname, in rank order: ``OUT/hosts.json``.
"""

import json
import socket
import sys
import time
from pathlib import Path

from train_runs import run  # first: sets up signals before MPI, as python -m geompi.train

# isort: split
from mpi4py import MPI

from tests.netns import read_counters, reshape

comm = MPI.COMM_WORLD
out, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
hosts = comm.allgather(socket.gethostname())
if comm.rank == 0:
    (out / "hosts.json").write_text(json.dumps(hosts))
for i, r in enumerate(spec):
    rate = r.get("rate")
    if comm.rank == 0:
        reshape(rate)
        before = read_counters()
    comm.Barrier()
    t0 = time.perf_counter()
    run(out, i, r["args"], r.get("env", {}))
    comm.Barrier()  # no rank starts a run while another still ends the last
    if comm.rank == 0:
        wall = time.perf_counter() - t0
        after = read_counters()
        record = {"rate": rate, "wall_s": wall, "before": before, "after": after}
        (out / f"run{i}.net.json").write_text(json.dumps(record))
