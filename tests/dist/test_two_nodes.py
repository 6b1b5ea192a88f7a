"""Two nodes on one machine: two torchrun agents (node ranks 0 and 1, c10d rendezvous on
loopback), each node's ranks reporting their own host name to the transport, so host_staged
moves bytes through shared memory between the ranks of a node and over gloo between the
nodes, in one training job. The job must train exactly like the same 4 ranks on one node with
torch.distributed's collectives."""

import subprocess
import sys

import pytest

from helpers.launch import FAST, QUICKSTART, REPO, _env, check, torchrun, train_losses
from helpers.spawn import _free_port

pytestmark = pytest.mark.slow

# The balancer's sample exchange and the prioritized pipeline's id, row and gradient
# exchanges all go through the transport.
JOB = ["train", "--config", str(QUICKSTART), *FAST, "--train.steps=6", "--balance.enable=true",
       "--train.pipeline=prioritized"]


def two_nodes(run, port: int, timeout: float = 600) -> list[subprocess.CompletedProcess]:
    agents = []
    for node in range(2):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node-rank={node}",
               "--nproc_per_node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
               "--rdzv-id=two-nodes", "-m", "freescale", *JOB, f"--run.dir={run}", "--transport.kind=host_staged",
               f"--transport.host_name=node{node}"]
        agents.append(subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True))
    done = []
    try:
        for agent in agents:
            out, err = agent.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(agent.args, agent.returncode, out, err))
    finally:  # a timeout or an interrupt: no agent outlives the test
        for agent in agents:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
    return done


def test_two_nodes_train_like_one(tmp_path):
    run = tmp_path / "two-nodes"
    for agent in two_nodes(run, _free_port()):
        check(agent)
    logs = sorted((run / "logs").glob("*.log"))
    assert len(logs) == 4
    for path in logs:
        layouts = [line for line in path.read_text().splitlines() if "host_staged:" in line]
        # Every transport the rank opened: its node's other rank through memory, two ranks elsewhere.
        assert layouts and all("1 peer(s) on this host" in line and "2 on other hosts" in line
                               for line in layouts), (path.name, layouts)
    reference = tmp_path / "one-node"
    check(torchrun(4, *JOB, f"--run.dir={reference}", "--transport.kind=torch_dist"))
    losses = train_losses(run)
    assert sorted(losses) == list(range(1, 7)) and losses == train_losses(reference)
