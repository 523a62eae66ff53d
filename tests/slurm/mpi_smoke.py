"""MPI smoke program for the Slurm tests (run by tests/slurm/smoke.sbatch).

Rank 0 prints ``smoke: size=N sum=S`` after an allreduce. With ``SMOKE_WAIT_SIGNAL=1`` on the
job's first run, every rank then waits (at most ``SMOKE_WAIT_SECONDS``) for SIGUSR1 or SIGTERM,
and rank 0 prints which signal each rank received, then ``smoke: preempted``. On a requeued run
(``SLURM_RESTART_COUNT`` > 0) it prints ``smoke: resumed restart=N`` instead of waiting.
With ``SMOKE_EXIT=N`` every rank exits with code N at the end. With ``SMOKE_PRINT_ENV=1`` rank 0
prints each ``OMPI_MCA_*``/``PRTE_MCA_*`` variable it got as ``smoke: env NAME=VALUE``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from mpi4py import MPI


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    got: list[str] = []

    def on_signal(signum, _frame):
        got.append(signal.Signals(signum).name)

    signal.signal(signal.SIGUSR1, on_signal)
    signal.signal(signal.SIGTERM, on_signal)

    total = comm.allreduce(rank, op=MPI.SUM)
    if rank == 0:
        print(f"smoke: size={size} sum={total} host={MPI.Get_processor_name()}", flush=True)

    if rank == 0 and os.environ.get("SMOKE_PRINT_ENV") == "1":
        for k in sorted(os.environ):
            if k.startswith(("OMPI_MCA_", "PRTE_MCA_")):
                print(f"smoke: env {k}={os.environ[k]}", flush=True)
        print("smoke: env end", flush=True)

    restart = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    if os.environ.get("SMOKE_WAIT_SIGNAL") == "1":
        if restart > 0:
            if rank == 0:
                print(f"smoke: resumed restart={restart}", flush=True)
        else:
            comm.Barrier()
            if rank == 0:
                print("smoke: waiting for a signal", flush=True)
            deadline = time.monotonic() + float(os.environ.get("SMOKE_WAIT_SECONDS", "120"))
            while not got and time.monotonic() < deadline:
                time.sleep(0.05)
            signals = comm.gather(got[0] if got else None, root=0)
            if rank == 0:
                print(f"smoke: signals={','.join(str(s) for s in signals)}", flush=True)
                print("smoke: preempted", flush=True)
    comm.Barrier()
    if rank == 0:
        print("smoke: done", flush=True)
    # SMOKE_EXIT=N: every rank exits with N, to check that the job reports the launcher's code.
    return int(os.environ.get("SMOKE_EXIT", "0"))


if __name__ == "__main__":
    sys.exit(main())
