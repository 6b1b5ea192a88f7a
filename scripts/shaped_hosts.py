"""Hosts joined by a shaped link, on one machine: network namespaces, veth pairs, a bridge, ``tc tbf``.

    .venv/bin/python scripts/shaped_hosts.py --hosts 2 --link-gbit 1 [--nproc-per-host 1]
        [--cpus 0 1] [--burst-kb 64] -- train --config configs/bench_embedding.yaml ...

runs ``torchrun -m freescale ARGS`` once per host (one agent per host, c10d rendezvous on the
first host's address); ``{host}`` in ARGS becomes the host's name (``host0``, ``host1``, ...),
for ``--transport.host_name={host}``: the hosts share this machine's host name and /dev/shm,
so a transport that looks for peers on its own host must be told which host it is on.

Layout: host k is the namespace ``<prefix>-h<k>`` with one interface ``eth0`` at 198.18.0.<k+1>/24
(198.18.0.0/15 is set aside for network benchmarks); its veth peer sits in a switch namespace
``<prefix>-sw`` on the bridge ``br0``. Each host's egress is shaped by a token bucket (``tc qdisc
... tbf``) to the link rate, so a byte between two hosts takes link time and no CPU while it
waits. Nothing is created in the machine's own namespace.

Teardown always happens: on exit, on an exception, on SIGTERM/SIGINT, and when this process is
killed outright: a reaper process in its own session holds a pipe from this one and tears the
namespaces down (every process in them killed first) when the pipe closes. Namespaces left by
a process that no longer exists are removed at the next start.

Needs root and iproute2 (``apt-get install iproute2``); ``available()`` says why not in one line.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from contextlib import contextmanager

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREFIX = "fsh"
"""Namespace names start with ``fsh-<pid of the process that made them>``."""
SUBNET = "198.18.0"
RDZV_PORT = 29400


def available() -> tuple[bool, str]:
    """Whether shaped hosts can be made here, and if not, why (one line)."""
    if os.name != "posix" or os.geteuid() != 0:
        return False, "shaped hosts need root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return False, f"shaped hosts need iproute2 ('{tool}' not found; apt-get install iproute2)"
    probe = f"{PREFIX}-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return False, f"shaped hosts: cannot create a network namespace ({made.stderr.strip()})"
    try:
        shaped = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                                 "rate", "1gbit", "burst", "64kb", "latency", "100ms"], capture_output=True, text=True)
        if shaped.returncode != 0:
            return False, f"shaped hosts: tc tbf is not available ({shaped.stderr.strip()})"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def _ip(*args: str, ns: str | None = None) -> None:
    cmd = ["ip", *args] if ns is None else ["ip", "netns", "exec", ns, "ip", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")


def namespaces(prefix: str = PREFIX) -> list[str]:
    """The namespaces whose name starts with ``prefix``."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(prefix)]


def teardown(prefix: str) -> None:
    """Kill every process in the namespaces named ``prefix*``, then delete them (their veths go with them)."""
    names = namespaces(prefix)
    for sig, pause in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 0.0)):
        pids = [int(p) for ns in names
                for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + pause
        while pids and time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.05)
    for ns in names:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def sweep_stale() -> None:
    """Remove namespaces left by helper processes that no longer exist."""
    for ns in namespaces(PREFIX + "-"):
        m = re.match(rf"{PREFIX}-(\d+)-", ns)
        if m and not _alive(int(m.group(1))):
            teardown(f"{PREFIX}-{m.group(1)}-")


def default_burst_kb(gbit: float) -> int:
    """A millisecond at the link rate, at least 64 KiB: a smaller bucket cannot keep a fast link
    busy between the kernel's timer ticks."""
    return max(64, int(gbit * 1e9 / 8 / 1000 / 1024))


class ShapedHosts:
    """``n`` hosts on a bridge, each host's egress shaped to ``gbit`` Gbit/s (``burst_kb`` of
    burst, default ``default_burst_kb``). ``cpus[k]``: the CPU cores host k's processes run on
    (None: any)."""

    def __init__(self, n: int, gbit: float, burst_kb: int | None = None, cpus: list[list[int]] | None = None) -> None:
        if n < 1 or n > 250:
            raise ValueError(f"hosts: expected 1 to 250, got {n}")
        if gbit <= 0:
            raise ValueError(f"link rate: expected a positive Gbit/s, got {gbit}")
        self.n, self.gbit, self.burst_kb = n, gbit, burst_kb or default_burst_kb(gbit)
        self.cpus = cpus
        self.prefix = f"{PREFIX}-{os.getpid()}-"
        self._reaper: subprocess.Popen | None = None

    def name(self, k: int) -> str:
        return f"{self.prefix}h{k}"

    def address(self, k: int) -> str:
        return f"{SUBNET}.{k + 1}"

    def up(self) -> "ShapedHosts":
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        sweep_stale()
        # The reaper first: from here on a kill of this process still tears everything down.
        self._reaper = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--reap", self.prefix],
                                        stdin=subprocess.PIPE, start_new_session=True)
        try:
            switch = f"{self.prefix}sw"
            _ip("netns", "add", switch)
            _ip("link", "add", "br0", "type", "bridge", ns=switch)
            _ip("link", "set", "br0", "up", ns=switch)
            for k in range(self.n):
                host = self.name(k)
                _ip("netns", "add", host)
                _ip("link", "set", "lo", "up", ns=host)
                _ip("link", "add", "eth0", "netns", host, "type", "veth", "peer", "name", f"h{k}", "netns", switch)
                _ip("link", "set", f"h{k}", "master", "br0", ns=switch)
                _ip("link", "set", f"h{k}", "up", ns=switch)
                _ip("addr", "add", f"{self.address(k)}/24", "dev", "eth0", ns=host)
                _ip("link", "set", "eth0", "up", ns=host)
                self._shape(host)
        except BaseException:
            self.down()
            raise
        return self

    def _shape(self, host: str) -> None:
        rate = f"{int(self.gbit * 1000)}mbit"
        cmd = ["ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", "eth0", "root", "tbf", "rate", rate,
               "burst", f"{self.burst_kb}kb", "latency", "200ms"]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)}: {proc.stderr.strip()}")

    def down(self) -> None:
        teardown(self.prefix)
        if self._reaper is not None:
            self._reaper.stdin.close()  # the reaper finds nothing left and exits
            self._reaper.wait()
            self._reaper = None

    def __enter__(self) -> "ShapedHosts":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    def command(self, k: int, cmd: list[str]) -> list[str]:
        """``cmd`` run on host k: in its namespace, gloo on its link, on its cores."""
        pinned = ["taskset", "-c", ",".join(map(str, self.cpus[k]))] if self.cpus else []
        return ["ip", "netns", "exec", self.name(k), "env", "GLOO_SOCKET_IFNAME=eth0", "TP_SOCKET_IFNAME=eth0",
                *pinned, *cmd]

    def torchrun(self, args: list[str], nproc_per_host: int = 1, run_id: str = "shaped", **popen) -> list[subprocess.Popen]:
        """One ``torchrun -m freescale ARGS`` agent per host, rendezvous on host 0; ``{host}`` in ARGS: the host's name."""
        agents = []
        for k in range(self.n):
            cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={self.n}", f"--node-rank={k}",
                   f"--nproc_per_node={nproc_per_host}", "--rdzv-backend=c10d",
                   f"--rdzv-endpoint={self.address(0)}:{RDZV_PORT}", f"--rdzv-id={run_id}",
                   f"--rdzv-conf=is_host={str(k == 0).lower()}",
                   f"--local-addr={self.address(k)}", "-m", "freescale",
                   *[a.replace("{host}", f"host{k}") for a in args]]
            agents.append(subprocess.Popen(self.command(k, cmd), cwd=REPO, **popen))
        return agents


@contextmanager
def shaped_hosts(n: int, gbit: float, **kwargs):
    hosts = ShapedHosts(n, gbit, **kwargs)
    with hosts:
        yield hosts


def _reap(prefix: str) -> None:
    """Wait for the helper's pipe to close (it exited or was killed), then tear down its namespaces."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdin.buffer.read()
    teardown(prefix)


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--reap":
        _reap(sys.argv[2])
        return 0
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hosts", type=int, default=2)
    parser.add_argument("--link-gbit", type=float, default=1.0, help="each host's egress rate, Gbit/s")
    parser.add_argument("--burst-kb", type=int, default=None,
                        help="the token bucket's burst, KiB (default: a millisecond at the rate, at least 64)")
    parser.add_argument("--nproc-per-host", type=int, default=1)
    parser.add_argument("--cpus", type=int, nargs="*", default=None,
                        help="cores per host, in order (each host gets nproc-per-host of them); default: any")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the freescale command line")
    ns = parser.parse_args()
    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    if not args:
        parser.error("expected -- and a freescale command line (e.g. -- train --config configs/quickstart.yaml)")
    ok, why = available()
    if not ok:
        print(why, file=sys.stderr)
        return 2
    cpus = None
    if ns.cpus:
        p = ns.nproc_per_host
        if len(ns.cpus) != ns.hosts * p:
            parser.error(f"--cpus: expected {ns.hosts * p} cores (hosts x nproc-per-host), got {len(ns.cpus)}")
        cpus = [ns.cpus[k * p:(k + 1) * p] for k in range(ns.hosts)]
    signal.signal(signal.SIGTERM, _raise_exit)
    with shaped_hosts(ns.hosts, ns.link_gbit, burst_kb=ns.burst_kb, cpus=cpus) as hosts:
        print(f"{ns.hosts} hosts ({', '.join(hosts.address(k) for k in range(ns.hosts))}), egress shaped to "
              f"{ns.link_gbit:g} Gbit/s", flush=True)
        agents = hosts.torchrun(args, ns.nproc_per_host)
        codes = [a.wait() for a in agents]
    return max(codes, key=abs)


if __name__ == "__main__":
    sys.exit(main())
