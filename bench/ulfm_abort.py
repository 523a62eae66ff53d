"""Does MPI_Abort end every rank under ``mpirun --with-ft ulfm``, also after a recovery?

    python bench/ulfm_abort.py          # prints one line per case; exit 1 if a rank survived

Each case launches 4 ranks of a bare mpi4py program (no geompi): ``plain`` has rank 1 call
``Abort``; ``after_recovery`` first SIGKILLs rank 3, lets the others Revoke and Shrink the
world, then has rank 1 call ``Abort`` on COMM_WORLD. A rank that outlives the abort by 3 s
prints ``alive``. geompi's runtime.abort relies on the answer (its line says every rank stops).
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

PROGRAM = """
import os, signal, sys, time
from mpi4py import MPI
c = MPI.COMM_WORLD
c.Set_errhandler(MPI.ERRORS_RETURN)
r = c.Get_rank()
if sys.argv[1] == "after_recovery":
    if r == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        c.Barrier()
    except MPI.Exception:
        c.Revoke()
    c.Shrink()
if r == 1:
    time.sleep(0.5)
    c.Abort(3)
time.sleep(3)
print("alive", r, flush=True)
os._exit(0)
"""


def main() -> int:
    here = pathlib.Path(sys.executable).with_name("mpirun")
    mpirun = str(here) if here.exists() else shutil.which("mpirun") or "mpirun"
    env = {**os.environ, "OMPI_MCA_btl": "self,tcp", "OMPI_MCA_pml": "ob1",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
           "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe"}  # fmt: skip
    survived = False
    with tempfile.TemporaryDirectory() as tmp:
        prog = pathlib.Path(tmp) / "abort.py"
        prog.write_text(PROGRAM)
        for case in ("plain", "after_recovery"):
            cmd = [mpirun, "--with-ft", "ulfm", "-n", "4", sys.executable, str(prog), case]
            t = time.perf_counter()
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
            alive = [ln for ln in res.stdout.splitlines() if ln.startswith("alive")]
            survived |= bool(alive)
            print(
                f"{case}: mpirun exit {res.returncode} after {time.perf_counter() - t:.1f} s; "
                f"ranks alive 3 s after the abort: {len(alive)}"
            )
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
