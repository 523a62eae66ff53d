"""Several ``python -m geompi.train`` runs, one after another, in one mpirun job: Python, torch
and MPI start once for all of them (tests/mpirun.py's ``train_runs`` launches this).

Usage: ``mpirun -n N python train_runs.py OUT SPEC``, SPEC a JSON file holding a list of
``{"args": [...], "env": {...}}``. Run i sees ``os.environ`` updated with its env (undone
after it) and calls ``geompi.train.main(args)``; each rank writes that run's stdout, stderr
and exit status (main's return or SystemExit's code) to ``OUT/run{i}.rank{r}.{out,err,rc}``.
Its stdout and stderr are the file descriptors themselves, so that nothing the run prints
(Python's or the MPI library's) lands in another run's files. A run that stops the job (an
error line, an abort) ends every run after it: each depends on the files of those before.
"""

import json
import os
import sys
from pathlib import Path

from geompi.runtime import end_process, install_signal_handlers, launcher_rank

install_signal_handlers()  # as python -m geompi.train: a stop signal at start-up is not fatal

from mpi4py import MPI  # noqa: E402

from geompi.train import main  # noqa: E402


def run(out: Path, i: int, args: list[str], env: dict[str, str]) -> None:
    """Run i of OUT (also for tests/progs/netns_runs.py, which imports it)."""
    rank = launcher_rank()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    kept = os.dup(1), os.dup(2)
    files = [open(out / f"run{i}.rank{rank}.{s}", "w") for s in ("out", "err")]  # noqa: SIM115
    os.dup2(files[0].fileno(), 1)
    os.dup2(files[1].fileno(), 2)
    try:
        rc = main(args)
    except SystemExit as e:
        rc = e.code if isinstance(e.code, int) else 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(kept[0], 1)
        os.dup2(kept[1], 2)
        for fd in kept:
            os.close(fd)
        for f in files:
            f.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    (out / f"run{i}.rank{rank}.rc").write_text(str(rc))


if __name__ == "__main__":
    out, spec = Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text())
    for i, r in enumerate(spec):
        run(out, i, r["args"], r.get("env", {}))
        MPI.COMM_WORLD.Barrier()  # no rank starts a run while another still ends the last
    end_process(0)  # as python -m geompi.train ends: no interpreter teardown
