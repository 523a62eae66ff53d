"""Mutants of the servers and their policies: each breaks one rule, and the in-process tests
(tests/test_servers_inprocess.py, tests/test_policies.py) must fail.

Run by hand, not by pytest (it edits geompi/ for a moment and restores each file in ``finally``;
a kill -9 in between leaves the mutant in place, which ``git diff`` shows)::

    .venv/bin/python tests/mutate_servers.py         # every mutant
    .venv/bin/python tests/mutate_servers.py 0 4     # some of them

Prints, per mutant, the in-process tests that caught it; exits 1 if one survived.
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent

# (what breaks, file, the text replaced (found exactly once), its replacement)
MUTANTS = [
    (
        "the local server averages its datacenter instead of summing it",
        "geompi/ps/local_server.py",
        "                    total.add_(buf)\n",
        "                    total.add_(buf)\n                total.div_(len(per_worker))\n",
    ),
    (
        "a wrong shard bound (ceil instead of floor)",
        "geompi/comm/topology.py",
        "return server * numel // g, (server + 1) * numel // g",
        "return -(-server * numel // g), -(-(server + 1) * numel // g)",
    ),
    (
        "the global servers divide a FLAG_SUM round by the weight",
        "geompi/ps/global_server.py",
        "self.optimizer.step(key, value, total, dc,",
        "self.optimizer.step(key, value, total.div_(weight), dc,",
    ),
    (
        "the global servers ignore presence (step every parameter)",
        "geompi/ps/global_server.py",
        "if self._present is None or key not in self.pieces:",
        "if True:",
    ),
    (
        "HFA goes global one round early",
        "geompi/ps/fragments.py",
        "return (round_index + shift(",
        "return (round_index + 1 + shift(",
    ),
    (
        "a forced global round does not restart the K2 count",
        "geompi/sync/hfa.py",
        "        if forced:\n            self.rounds.update(",
        "        if False:\n            self.rounds.update(",
    ),
    (
        "the outer Nesterov step without its look-ahead",
        "geompi/sync/hfa.py",
        "lr=s.lr, dampening=s.dampening, nesterov=s.nesterov,",
        "lr=s.lr, dampening=s.dampening, nesterov=False,",
    ),
    (
        "the local server sends its datacenter average, not its sum, to the global tier",
        "geompi/ps/local_server.py",
        "if i == pos else total)",
        "if i == pos else total / weight)",
    ),
    (
        "a skipped datacenter's gradient is still used",
        "geompi/ps/global_server.py",
        "used = [ls for ls in senders if rnd.op is not Op.GRAD or weights[ls] > 0]",
        "used = list(senders)",
    ),
    (
        "DCASGD without its delay compensation",
        "geompi/ps/optim.py",
        "d = d + lam * gg * (w - bak)",
        "d = d",
    ),
    (
        "the scattering workers push their own slice, not the peers' sum",
        "geompi/ps/client.py",
        "                    mine.add_(part)\n",
        "                    pass\n",
    ),
    (
        "the mean key (buffers) is stepped by the optimizer, not averaged",
        "geompi/ps/global_server.py",
        "if i == mean and key in self.values:",
        "if False:",
    ),
]


def main(only: list[str]) -> int:
    survived = 0
    for i, (what, path, old, new) in enumerate(MUTANTS):
        if only and str(i) not in only:
            continue
        p = ROOT / path
        src = p.read_text()
        assert src.count(old) == 1, f"mutant {i} ({what}) no longer applies to {path}"
        p.write_text(src.replace(old, new))
        try:
            r = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                 "tests/test_servers_inprocess.py", "tests/test_policies.py"],
                capture_output=True, text=True, cwd=ROOT, timeout=600,
                env={**os.environ, "PYTHONPATH": str(ROOT)},
            )  # fmt: skip
        finally:
            p.write_text(src)
        failed = [ln.split("::")[1].split(" ")[0] for ln in r.stdout.splitlines()
                  if ln.startswith("FAILED")]  # fmt: skip
        survived += not failed
        caught = ", ".join(failed) if failed else "NONE: the mutant survived"
        print(f"[{i}] {what}: {caught}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
