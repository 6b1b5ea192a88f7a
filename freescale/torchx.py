"""A TorchX component: a lighthouse and R replica groups of N ranks as one job on a cluster.

``freescale local`` starts the groups on one host and restarts them itself; on a cluster each
group is a role of a TorchX app, and what restarts it is not FreeScale:

- a rank that dies (a crash, an OOM kill) takes its group down, and the group's ``torchrun``
  agent starts all its ranks again (``max_restarts``, torchelastic's restarts of the group);
- a group whose agent is lost too (its host, its pod) is started again by the scheduler
  (``max_retries``, the role's retries; ``RetryPolicy.REPLICA``: only that role's replica).

Either way the group starts in its own folder again (``<run>/replica<r>/``), finds the commits
it left there and joins the live groups as ``freescale local``'s restarted groups do
(``ReplicaLayer.join``: catch up from a live peer, or the job's newest checkpoint when none is
left). The other groups keep training meanwhile; nothing here waits for the restart.

Each group gets what ``freescale local`` gives it: torchrun's launcher with N ranks (here
``torchrun --standalone``, whose agent restarts them in place; ``freescale local`` runs the same
launcher inside ``freescale train --nproc N`` and restarts a group itself), ``freescale train``
with the config and its overrides, ``ft.enable``, ``ft.num_replicas=R``, ``ft.replica_id=r``,
``run.dir=<run>/replica<r>`` and one thread per rank unless told otherwise, and a rendezvous store per start of its ranks (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE``,
without which torchrun's in-place restart fails); the lighthouse's address comes in torchft's ``TORCHFT_LIGHTHOUSE``. The lighthouse
is role 0 (``freescale lighthouse``), bound to ``lighthouse_bind`` and dialled at
``lighthouse_host`` (both loopback by default: one host). On a cluster it must bind an address
the groups reach (``0.0.0.0``), and ``lighthouse_host=role0`` dials the host the scheduler put
role 0 on (TorchX's rank-0 host variable: SLURM's first heterogeneous group's node list,
Volcano's ``VC_LIGHTHOUSE_0_HOSTS`` on Kubernetes). It exits once every group has finished the
run, so the job ends with them.

The run folder must be one file system every group sees (a shared one on a cluster): a group
that restarts when no other is live resumes from the newest checkpoint of any group's folder.

    torchx run -s local_cwd freescale/torchx.py:replica_groups --config configs/ft_local.yaml \\
        --replicas 2 --nproc 2 -- train.steps=400
"""

import shlex  # (no ``from __future__ import annotations``: TorchX reads the parameters' types at run time)
from typing import Dict, List, Optional

import torchx.specs as specs

from freescale.config import ConfigError, load_config
from freescale.env import TORCH_DISABLE_SHARE_RDZV_TCP_STORE, TORCHFT_LIGHTHOUSE

ROLE0_HOST = "role0"
"""``lighthouse_host``'s value for the host the scheduler placed the lighthouse role on."""
LOOPBACK = ("127.", "localhost", "::1")
SET_BY_THE_COMPONENT = ("ft.enable", "ft.num_replicas", "ft.replica_id", "ft.lighthouse")


def replica_groups(
    *overrides: str,
    config: str = "configs/ft_local.yaml",
    replicas: int = 2,
    nproc: int = 1,
    run_dir: str = "",
    lighthouse_host: str = "127.0.0.1",
    lighthouse_bind: str = "127.0.0.1",
    lighthouse_port: int = 29510,
    max_restarts: int = 3,
    max_retries: int = 3,
    image: str = "",
    cpu: int = 2,
    gpu: int = 0,
    memMB: int = 4096,
    h: Optional[str] = None,
    env: Optional[Dict[str, str]] = None,
    mounts: Optional[List[str]] = None,
) -> specs.AppDef:
    """A torchft lighthouse and ``replicas`` FreeScale replica groups of ``nproc`` ranks, each
    group a role the scheduler restarts on its own.

    Args:
        overrides: config overrides, section.key=value (a leading -- is allowed)
        config: the experiment YAML (read here to check it, and by every group)
        replicas: replica groups (ft.num_replicas)
        nproc: ranks per replica group (one host each)
        run_dir: the job's run folder, each group in run_dir/replica<r>/ (default: run.dir, else
            run.out_dir/run.name-<app id>); shared by every group
        lighthouse_host: the host the groups dial for the lighthouse; role0: the host the
            scheduler placed the lighthouse role on
        lighthouse_bind: the address the lighthouse listens on (0.0.0.0 on a cluster)
        lighthouse_port: the lighthouse's port
        max_restarts: torchrun's restarts of a group whose rank fails (its agent lives on)
        max_retries: the scheduler's restarts of a group's role (its host or pod lost)
        image: the image every role runs (the scheduler's kind: a docker image, a folder)
        cpu: CPUs per replica group
        gpu: GPUs per replica group
        memMB: memory per replica group, in MB
        h: a registered named resource per replica group (takes precedence over cpu, gpu, memMB)
        env: environment variables for every role
        mounts: mounts for every role (type=bind|volume,src=...,dst=...), e.g. the shared run folder
    """
    overrides = tuple(o[2:] if o.startswith("--") else o for o in overrides)
    for name, value, least in (("replicas", replicas, 1), ("nproc", nproc, 1), ("max_restarts", max_restarts, 0),
                               ("max_retries", max_retries, 0)):
        if value < least:
            raise ConfigError(f"--{name}: expected a value >= {least}, got {value}")
    if not 0 < lighthouse_port < 65536:
        raise ConfigError(f"--lighthouse_port: expected a port in 1..65535, got {lighthouse_port}")
    if lighthouse_bind.startswith(LOOPBACK) and not lighthouse_host.startswith(LOOPBACK):
        raise ConfigError(f"--lighthouse_host {lighthouse_host}: the lighthouse binds {lighthouse_bind}, which only "
                          f"this host reaches; give --lighthouse_bind an address the groups reach (e.g. 0.0.0.0)")
    for override in overrides:
        key = override.split("=", 1)[0]
        if key in SET_BY_THE_COMPONENT:
            raise ConfigError(f"{override}: {key} is set by the component (--replicas, the role, the lighthouse)")
    ft = ["ft.enable=true", f"ft.num_replicas={replicas}"]
    cfg = load_config(config, [*overrides, *ft])  # bad input fails here, before anything is submitted
    run_dir = run_dir or cfg.run.dir or f"{cfg.run.out_dir}/{cfg.run.name}-{specs.macros.app_id}"
    overrides = tuple(o for o in overrides if o.split("=", 1)[0] != "run.dir")
    env = dict(env or {})
    env.setdefault("RUST_LOG", "warn")  # torchft logs every quorum and vote at info
    mounted = specs.parse_mounts(mounts) if mounts else []

    lighthouse = specs.Role(
        name="lighthouse",
        image=image,
        entrypoint="python",
        args=["-m", "freescale", "lighthouse", "--bind", f"{lighthouse_bind}:{lighthouse_port}",
              "--min-replicas", str(cfg.ft.min_replicas), "--until-done", run_dir, "--replicas", str(replicas)],
        env=dict(env),  # each role its own (a scheduler adds to it)
        resource=specs.resource(cpu=1, gpu=0, memMB=1024),
        port_map={"lighthouse": lighthouse_port},
        max_retries=max_retries,
        retry_policy=specs.RetryPolicy.REPLICA,
        mounts=mounted,
    )
    # A host that the group's shell expands: role 0's, as the scheduler names it at run time.
    host = f"$${{{specs.macros.rank0_env}:-127.0.0.1}}" if lighthouse_host == ROLE0_HOST else shlex.quote(lighthouse_host)
    groups = []
    for r in range(replicas):
        train = ["torchrun", "--standalone", f"--nproc_per_node={nproc}", f"--max_restarts={max_restarts}",
                 "-m", "freescale", "train", "--config", config, *(f"--{o}" for o in overrides),
                 *(f"--{o}" for o in ft), f"--ft.replica_id={r}", f"--run.dir={run_dir}/replica{r}"]
        groups.append(specs.Role(
            name=f"replica{r}",
            image=image,
            entrypoint="bash",
            args=["-c", f"export {TORCHFT_LIGHTHOUSE}=http://{host}:{lighthouse_port}; exec {shlex.join(train)}"],
            env={"OMP_NUM_THREADS": "1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1", **env},
            resource=specs.resource(cpu=cpu, gpu=gpu, memMB=memMB, h=h),
            max_retries=max_retries,
            retry_policy=specs.RetryPolicy.REPLICA,
            mounts=mounted,
        ))
    return specs.AppDef(name="freescale", roles=[lighthouse, *groups])
