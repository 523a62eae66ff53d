"""Datacenters in real network namespaces: one MPI job whose hosts are Linux network namespaces.

Each host (a datacenter, and the global servers on a host of their own) is a network namespace
joined by a veth pair to a bridge in the root namespace, with an address on a private /24.
``mpirun`` starts in the root namespace and reaches the hosts over TCP only: a hostfile names one
host per namespace and an rsh agent (``--prtemca plm_ssh_agent``, once ``plm_rsh_agent``) enters
the host's namespace (``ip netns exec``) and gives it its own hostname (``unshare --uts``), so
``--dc-map nodes`` sees one node per namespace. The links of the shaped hosts (the datacenters)
are limited in the kernel with ``tc`` (``tbf``, both directions of each veth; its queue holds
100 ms at the rate and at least 1 MB, beyond which it drops). There is no ``netem`` here, so
latency is not added by the kernel: it stays in geompi's link model.

Root only: :func:`unavailable` says in one line why not (tests skip with it). Names start with a
prefix that holds this process's id (``gmn<pid hex>``); every namespace, veth and bridge goes in
``finally``, on SIGTERM/SIGINT too, and those of an earlier run whose process is gone are removed
at start. Every mpirun has a hard timeout (its process group is killed).

As a script, it launches any command across namespaces::

    python tests/netns.py --hosts dc0:3,dc1:3,gs:1 --rate 100mbit -- \\
        python -m geompi.train --dc-map nodes --sync hfa
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script: tests.mpirun

from tests.mpirun import LAUNCH_TRIES, _failed_to_launch  # noqa: E402

BIN = Path(sys.executable).parent
PREFIX_RE = re.compile(r"^gmn([0-9a-f]+)[-.]")  # gmn<pid hex>-...: ours; the pid ran it
# Open MPI over TCP only, on the bridge's subnet (the single-machine settings of
# geompi.runtime.LOCAL_OPENMPI_ENV, less shared memory)
MPI_ENV = {
    "OMPI_ALLOW_RUN_AS_ROOT": "1",
    "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1",
    "PRTE_MCA_rmaps_default_mapping_policy": ":oversubscribe",
    "OMPI_MCA_osc": "rdma",
    "OMPI_MCA_pml": "ob1",
    "OMPI_MCA_btl": "self,tcp",
    "OMPI_MCA_mpi_yield_when_idle": "1",
    "OMP_NUM_THREADS": "1",
    "PYTHONUNBUFFERED": "1",
}
COUNTERS = ("rx_bytes", "tx_bytes", "rx_packets", "tx_packets")
AGENT = """#!/bin/sh
# rsh agent for mpirun: [options] HOST COMMAND... -> COMMAND in HOST's network namespace,
# under HOST as its hostname (a UTS namespace of its own)
while [ $# -gt 0 ]; do case "$1" in -*) shift ;; *) break ;; esac; done
host=$1
shift
exec ip netns exec "$host" unshare --uts /bin/sh -c "hostname $host && $*"
"""


def sh(*cmd: str, check: bool = True, netns: str | None = None) -> str:
    full = ["ip", "netns", "exec", netns, *cmd] if netns else list(cmd)
    r = subprocess.run(full, capture_output=True, text=True, timeout=30)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(full)}: {r.stderr.strip()}")
    return r.stdout


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"no {tool} here (iproute2/util-linux)"
    # every kind of object a Cluster makes, once: a machine (or container) that lacks one of
    # them skips with its line instead of failing half-way through a test
    probe = f"gmn{os.getpid():x}-probe"
    steps = [
        ("ip netns", ("ip", "netns", "add", probe), None),
        ("a bridge", ("ip", "link", "add", f"{probe}b", "type", "bridge"), None),
        ("a veth pair", ("ip", "link", "add", f"{probe}o", "type", "veth", "peer", "name",
                         f"{probe}i"), None),
        ("tc tbf", ("tc", "qdisc", "replace", "dev", f"{probe}o", "root", "tbf", "rate",
                    "1mbit", "burst", "16000", "latency", "100ms"), None),
        ("unshare --uts", ("unshare", "--uts", "true"), probe),
    ]  # fmt: skip
    try:
        for what, cmd, netns in steps:
            try:
                sh(*cmd, netns=netns)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
                return f"{what} unavailable here: {str(e).splitlines()[0] if str(e) else e}"
        return None
    finally:
        for dev in (f"{probe}o", f"{probe}b"):
            sh("ip", "link", "del", dev, check=False)
        sh("ip", "netns", "del", probe, check=False)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def ours() -> tuple[list[str], list[str]]:
    """The namespaces and links named by this harness (any run's)."""
    names = [ln.split()[0] for ln in sh("ip", "netns", "list").splitlines() if ln.strip()]
    links = [
        ln.split(":")[1].strip().split("@")[0]
        for ln in sh("ip", "-o", "link", "show").splitlines()
        if ":" in ln
    ]
    return [n for n in names if PREFIX_RE.match(n)], [x for x in links if PREFIX_RE.match(x)]


def drop_netns(ns: str) -> None:
    """Kill what still runs in namespace ``ns``, then delete it (quietly if it is gone)."""
    for pid in sh("ip", "netns", "pids", ns, check=False).split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
    sh("ip", "netns", "del", ns, check=False)


def remove_stale() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (and the processes still
    inside those namespaces); returns their names."""
    gone = []
    spaces, links = ours()
    for name in spaces + links:
        m = PREFIX_RE.match(name)
        if m and not _pid_alive(int(m.group(1), 16)):
            gone.append(name)
    for ns in (n for n in spaces if n in gone):
        drop_netns(ns)
    for link in (x for x in links if x in gone):
        sh("ip", "link", "del", link, check=False)
    return gone


def _free_subnet() -> str:
    used = sh("ip", "-o", "addr") + sh("ip", "route")
    for third in range(os.getpid() % 200, 256):
        net = f"10.213.{third}"
        if f"{net}." not in used:
            return net
    raise RuntimeError("no free 10.213.x.0/24 subnet")


def tbf(
    dev: str, rate_bps: float | None, netns: str | None = None, enter: Sequence[str] = ()
) -> None:
    """Limit ``dev``'s egress to ``rate_bps`` bits/s with a token bucket (None: unlimited); in
    NETNS, or through the command ENTER (e.g. ``nsenter --net=...``)."""
    if rate_bps is None:
        sh(*enter, "tc", "qdisc", "del", "dev", dev, "root", check=False, netns=netns)
        return
    # a burst of 4 ms at the rate (500 kB at 1 Gbit/s, which the kernel's timer needs), and at
    # least two full frames: a larger floor lets a slow link pass whole messages at the veth's
    # speed (16 kB, the floor once, is 256 ms at 0.5 Mbit/s: int4 rounds of 40 kB then ran 31%
    # faster than the rate allows, bench/plan_check.py --kernel); the queue holds 100 ms at the
    # rate, and at least 1 MB (a round of the tests' model), before it drops
    burst = max(2 * 1514, int(rate_bps / 8 * 0.004))
    queue_ms = max(100, int(1e6 / (rate_bps / 8) * 1000))
    sh(
        *enter,
        *("tc", "qdisc", "replace", "dev", dev, "root", "tbf"),
        *("rate", f"{int(rate_bps)}bit", "burst", str(burst), "latency", f"{queue_ms}ms"),
        netns=netns,
    )


class Cluster:
    """Namespaces ``HOSTS`` (name, slots), the first ``shaped`` of them behind a shaped link.

    Use as a context manager; everything it made goes on exit (and on SIGTERM/SIGINT, which
    raise KeyboardInterrupt in the main thread while it is open)."""

    def __init__(self, hosts: Sequence[tuple[str, int]], shaped: int | None = None) -> None:
        self.prefix = f"gmn{os.getpid():x}"
        self.hosts = [(f"{self.prefix}-{name}", slots) for name, slots in hosts]
        self.shaped = len(hosts) - 1 if shaped is None else shaped
        self.bridge = f"{self.prefix}-br"
        self.dir = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-"))
        self.net = ""
        self._signals: dict = {}

    # the host side of host i's veth (in the root namespace), and the namespace's side
    def outer(self, i: int) -> str:
        return f"{self.prefix}-{i}o"

    def inner(self, i: int) -> str:
        return f"{self.prefix}-{i}i"

    @property
    def names(self) -> list[str]:
        return [h for h, _ in self.hosts]

    @property
    def subnet(self) -> str:
        return f"{self.net}.0/24"

    def __enter__(self) -> Cluster:
        import threading

        if threading.current_thread() is threading.main_thread():
            for s in (signal.SIGTERM, signal.SIGINT):
                self._signals[s] = signal.signal(s, _interrupt)
        try:
            remove_stale()
            self._create()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _create(self) -> None:
        self.net = _free_subnet()
        sh("ip", "link", "add", self.bridge, "type", "bridge")
        sh("ip", "addr", "add", f"{self.net}.1/24", "dev", self.bridge)
        sh("ip", "link", "set", self.bridge, "up")
        for i, (ns, _) in enumerate(self.hosts):
            sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.outer(i), "type", "veth", "peer", "name", self.inner(i))
            sh("ip", "link", "set", self.inner(i), "netns", ns)
            sh("ip", "link", "set", self.outer(i), "master", self.bridge, "up")
            sh("ip", "addr", "add", f"{self.net}.{i + 2}/24", "dev", self.inner(i), netns=ns)
            sh("ip", "link", "set", self.inner(i), "up", netns=ns)
            sh("ip", "link", "set", "lo", "up", netns=ns)
        hostfile = "".join(f"{ns} slots={slots}\n" for ns, slots in self.hosts)
        (self.dir / "hostfile").write_text(hostfile)
        agent = self.dir / "agent.sh"
        agent.write_text(AGENT)
        agent.chmod(0o755)

    def __exit__(self, *exc) -> None:
        try:
            self.cleanup()
        finally:
            for s, h in self._signals.items():
                signal.signal(s, h)
            self._signals.clear()

    def cleanup(self) -> None:
        for ns, _ in self.hosts:
            drop_netns(ns)
        for i in range(len(self.hosts)):
            sh("ip", "link", "del", self.outer(i), check=False)
        sh("ip", "link", "del", self.bridge, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)

    def shape(self, rate_bps: float | None) -> None:
        """Limit each shaped host's link to ``rate_bps`` bits/s both ways (None: unlimited)."""
        for i in range(self.shaped):
            tbf(self.outer(i), rate_bps)  # into the host
            tbf(self.inner(i), rate_bps, netns=self.hosts[i][0])  # out of it

    def counters(self) -> list[dict[str, int]]:
        """The kernel's counters (COUNTERS) of each host's link, seen from the bridge (rx: what
        the host sent, tx: what it received)."""
        out = []
        for i in range(len(self.hosts)):
            stats = Path("/sys/class/net") / self.outer(i) / "statistics"
            out.append({k: int((stats / k).read_text()) for k in COUNTERS})
        return out

    def control_env(self) -> dict[str, str]:
        """What a rank needs to call :func:`reshape` and :func:`read_counters` from inside."""
        return {
            "GEOMPI_NETNS": json.dumps(
                {
                    "root": f"/proc/{os.getpid()}/ns/net",
                    "hosts": self.names,
                    "shaped": self.shaped,
                    "prefix": self.prefix,
                }
            )
        }

    def mpirun_cmd(self, argv: Sequence[str]) -> list[str]:
        n = sum(slots for _, slots in self.hosts)
        mpirun = BIN / "mpirun"
        return [
            str(mpirun if mpirun.exists() else shutil.which("mpirun") or "mpirun"),
            *("-n", str(n), "--hostfile", str(self.dir / "hostfile")),
            *("--map-by", "slot", "--prtemca", "plm_ssh_agent", str(self.dir / "agent.sh")),
            *("--prtemca", "plm_ssh_no_tree_spawn", "1"),
            *("--prtemca", "prte_if_include", self.subnet),
            *("--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", self.subnet),
            *("-x", "PYTHONPATH", "-x", "GEOMPI_NETNS"),
            *argv,
        ]

    def run(
        self, argv: Sequence[str], timeout: float, env: dict | None = None
    ) -> subprocess.CompletedProcess:
        """``mpirun`` ARGV across the namespaces, killed (its whole process group) after
        TIMEOUT seconds: then raises TimeoutError with what it printed."""
        full_env = {
            **os.environ,
            **MPI_ENV,
            "PYTHONPATH": str(REPO),
            **self.control_env(),
            **(env or {}),
        }
        cmd = self.mpirun_cmd(argv)
        for _ in range(LAUNCH_TRIES):  # mpirun's own start-up failures, as tests/mpirun.py
            res = self._run_once(cmd, timeout, full_env)
            if not _failed_to_launch(res):
                break
            print(f"mpirun could not start; trying again: {res.stderr.strip()}", file=sys.stderr)
        return res

    def _run_once(
        self, cmd: list[str], timeout: float, full_env: dict
    ) -> subprocess.CompletedProcess:
        p = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            out, err = p.communicate(timeout=timeout)
        except BaseException as e:
            os.killpg(p.pid, signal.SIGKILL)
            out, err = p.communicate()
            if isinstance(e, subprocess.TimeoutExpired):
                raise TimeoutError(
                    f"{' '.join(cmd)}: still running after {timeout} s\n{out}\n{err}"
                ) from None
            raise
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)


class Stopped(KeyboardInterrupt):
    """SIGTERM or SIGINT while a Cluster is open."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Stopped(signum)


# From inside a rank of a job that Cluster.run started (any namespace): the same operations,
# entering the root namespace (where the bridge side of each veth lives) with nsenter.
def _control() -> dict:
    spec = os.environ.get("GEOMPI_NETNS")
    if not spec:
        raise RuntimeError("not in a job started by tests/netns.py (no GEOMPI_NETNS)")
    return json.loads(spec)


def reshape(rate_bps: float | None) -> None:
    """:meth:`Cluster.shape`, from a rank."""
    c = _control()
    for i in range(c["shaped"]):
        tbf(f"{c['prefix']}-{i}o", rate_bps, enter=("nsenter", f"--net={c['root']}"))
        tbf(f"{c['prefix']}-{i}i", rate_bps, netns=c["hosts"][i])


def read_counters() -> list[dict[str, int]]:
    """:meth:`Cluster.counters`, from a rank: the namespace side of each veth, whose rx is the
    bridge side's tx and the other way round."""
    c = _control()
    out = []
    for i, ns in enumerate(c["hosts"]):
        info = json.loads(sh("ip", "-n", ns, "-s", "-j", "link", "show", f"{c['prefix']}-{i}i"))
        stats = info[0]["stats64"]
        out.append(
            {
                "rx_bytes": stats["tx"]["bytes"],
                "tx_bytes": stats["rx"]["bytes"],
                "rx_packets": stats["tx"]["packets"],
                "tx_packets": stats["rx"]["packets"],
            }
        )
    return out


def parse_hosts(text: str) -> list[tuple[str, int]]:
    hosts = []
    for part in text.split(","):
        name, _, slots = part.partition(":")
        if not re.fullmatch(r"[a-z0-9]{1,6}", name) or not slots.isdigit() or int(slots) < 1:
            raise ValueError(f"--hosts {text!r}: give NAME:SLOTS,... (NAME a-z0-9, up to 6)")
        hosts.append((name, int(slots)))
    return hosts


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description="Run COMMAND with mpirun across network namespaces (one per host), the "
        "datacenters' links shaped in the kernel by tc tbf. Root only.",
        epilog="e.g. python tests/netns.py --hosts dc0:3,dc1:3,gs:1 --rate 100mbit -- "
        "python -m geompi.train --dc-map nodes --sync hfa",
    )
    p.add_argument("--hosts", default="dc0:3,dc1:3,gs:1", help="NAME:SLOTS,... (ranks in order)")
    p.add_argument(
        "--shaped", type=int, help="the first N hosts are shaped (default: all but last)"
    )
    p.add_argument("--rate", help="e.g. 100mbit, 1gbit (default: unshaped)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before mpirun is killed")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    args = p.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        hosts = parse_hosts(args.hosts)
        rate = _rate(args.rate) if args.rate else None
    except ValueError as e:
        print(f"netns: error: {e}", file=sys.stderr)
        return 2
    if not command:
        print("netns: error: give a command after --", file=sys.stderr)
        return 2
    why = unavailable()
    if why:
        print(f"netns: skipped: {why}", file=sys.stderr)
        return 0
    try:
        return _launch(hosts, args.shaped, rate, command, args.timeout)
    except Stopped as e:
        print(f"netns: stopped by signal {e.signum}", file=sys.stderr)
        return 128 + e.signum


def _launch(hosts, shaped, rate, command, timeout) -> int:
    with Cluster(hosts, shaped) as c:
        c.shape(rate)
        t0 = time.perf_counter()
        try:
            res = c.run(command, timeout)
        except TimeoutError as e:
            first, _, rest = str(e).partition("\n")
            print(rest, file=sys.stderr)  # what the job printed
            print(f"netns: error: {first}", file=sys.stderr)
            return 124
        sys.stdout.write(res.stdout)
        sys.stderr.write(res.stderr)
        wall = time.perf_counter() - t0
        for (ns, _), k in zip(c.hosts, c.counters(), strict=True):
            print(
                f"netns: {ns}: sent {k['rx_bytes']} B, received {k['tx_bytes']} B", file=sys.stderr
            )
        print(f"netns: mpirun exited {res.returncode} after {wall:.1f} s", file=sys.stderr)
        return res.returncode


def _rate(text: str) -> float:
    m = re.fullmatch(r"([0-9.]+)\s*(kbit|mbit|gbit)", text.strip().lower())
    if not m:
        raise ValueError(f"--rate {text!r}: give e.g. 100mbit or 1gbit")
    return float(m.group(1)) * {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}[m.group(2)]


if __name__ == "__main__":
    sys.exit(main())
