"""Two hosts joined by a shaped link (``scripts/shaped_hosts.py``: network namespaces, veth
pairs, a bridge, ``tc tbf``): one torchrun agent per host, c10d rendezvous on the first host's
address, each host's ranks reporting their host's name to the transport, so host_staged moves
bytes through shared memory between the ranks of a host and over gloo across the link, in one
training job. The job must train exactly like the same 4 ranks on one host with
torch.distributed's collectives; the link must take the time its rate says (a job trains alike
whether or not ``tc`` shaped anything); and the helper must leave nothing behind, even killed."""

import os
import signal
import subprocess
import sys
import time

import pytest

from helpers.launch import FAST, QUICKSTART, REPO, _env, check, ranks, train_losses

sys.path.insert(0, str(REPO / "scripts"))
from shaped_hosts import PREFIX, ShapedHosts, available, namespaces  # noqa: E402

OK, WHY = available()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not OK, reason=WHY)]

# The balancer's sample exchange and the prioritized pipeline's id, row and gradient
# exchanges all go through the transport.
JOB = ["train", "--config", str(QUICKSTART), *FAST, "--train.steps=6", "--balance.enable=true",
       "--train.pipeline=prioritized"]


def test_two_shaped_hosts_train_like_one(tmp_path):
    run = tmp_path / "two-hosts"
    with ShapedHosts(2, gbit=0.5) as hosts:
        agents = hosts.torchrun([*JOB, f"--run.dir={run}", "--transport.kind=host_staged",
                                 "--transport.host_name={host}"], nproc_per_host=2, env=_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for agent in agents:
            out, err = agent.communicate(timeout=600)
            check(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    logs = sorted((run / "logs").glob("*.log"))
    assert len(logs) == 4
    for path in logs:
        layouts = [line for line in path.read_text().splitlines() if "host_staged:" in line]
        # Every transport the rank opened: its host's other rank through memory, two ranks elsewhere.
        assert layouts and all("1 peer(s) on this host" in line and "2 on other hosts" in line
                               for line in layouts), (path.name, layouts)
    reference = tmp_path / "one-host"
    check(ranks(4, *JOB, f"--run.dir={reference}", "--transport.kind=torch_dist"))
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses == train_losses(reference)


# A receiver on a host: it says when it listens, then reports the bytes it got and the seconds
# from the connection to the sender's end.
RECEIVER = """
import socket, sys, time
server = socket.create_server((sys.argv[1], int(sys.argv[2])))
print("listening", flush=True)
conn, _ = server.accept()
started, got = time.monotonic(), 0
while chunk := conn.recv(1 << 16):
    got += len(chunk)
print(got, time.monotonic() - started, flush=True)
"""
SENDER = """
import socket, sys
with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=60) as conn:
    conn.sendall(bytes(int(sys.argv[3])))
"""
LINK_MBIT = 40  # slow enough that the transfer takes a second, fast enough for a short test
SENT = 5_000_000  # bytes: 1.0 s at 40 Mbit/s


def _transfer(hosts: ShapedHosts, sender: int, receiver: int, port: int) -> float:
    """Seconds ``SENT`` bytes take over TCP from host ``sender`` to host ``receiver``."""
    listening = subprocess.Popen(hosts.command(receiver, [sys.executable, "-c", RECEIVER, hosts.address(receiver),
                                                          str(port)]), stdout=subprocess.PIPE, text=True)
    try:
        assert listening.stdout.readline().strip() == "listening"
        subprocess.run(hosts.command(sender, [sys.executable, "-c", SENDER, hosts.address(receiver), str(port),
                                              str(SENT)]), check=True, timeout=60)
        got, seconds = listening.communicate(timeout=60)[0].split()
    finally:
        listening.kill()
        listening.wait()
    assert int(got) == SENT
    return float(seconds)


def test_the_link_takes_the_time_its_rate_says():
    # A speed check, on purpose: unshaped, the veths move these bytes in milliseconds, and every
    # other test here passes whether or not tc shaped anything. A busy machine can only make the
    # transfer slower, so the lower bound is the guard and the upper one is loose. Each way,
    # since each host's egress has a bucket of its own. (TCP/IP headers add about 4% on the wire.)
    expected = SENT * 8 / (LINK_MBIT * 1e6)
    with ShapedHosts(2, gbit=LINK_MBIT / 1000) as hosts:
        for sender, receiver in ((0, 1), (1, 0)):
            seconds = _transfer(hosts, sender, receiver, port=29600 + sender)
            assert 0.7 * expected <= seconds <= 1.6 * expected + 2.0, (sender, receiver, seconds, expected)


def _links() -> str:
    return subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


def test_a_killed_helper_leaves_no_namespace_link_or_process_behind(tmp_path):
    links_before = _links()
    helper = subprocess.Popen([sys.executable, str(REPO / "scripts" / "shaped_hosts.py"), "--hosts", "2",
                               "--link-gbit", "1", "--", *JOB, "--train.steps=100000", f"--run.dir={tmp_path / 'run'}",
                               "--transport.host_name={host}"], cwd=REPO, env=_env(),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mine = f"{PREFIX}-{helper.pid}-"
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "run" / "logs").is_dir():  # the job is up on both hosts
            assert helper.poll() is None and time.monotonic() < deadline, "the job did not start"
            time.sleep(0.2)
        inside = [int(p) for ns in namespaces(mine)
                  for p in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()]
        assert len(namespaces(mine)) == 3 and inside  # two hosts and the switch, processes on the hosts
    finally:
        os.kill(helper.pid, signal.SIGKILL)
        helper.wait()
    deadline = time.monotonic() + 60
    while (namespaces(mine) or any(_alive(p) for p in inside)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert namespaces(mine) == [] and not [p for p in inside if _alive(p)]
    assert _links() == links_before  # nothing was ever made in the machine's own namespace


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie waiting for its parent's wait is gone
        return f.read().split(") ")[-1][0] != "Z"
