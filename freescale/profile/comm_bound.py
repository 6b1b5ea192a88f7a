"""The bound under a step's exposed communication on a link: what of its embedding exchange no
schedule can hide.

On a link that moves ``link_gbit`` Gbit/s out of each host (``scripts/shaped_hosts.py`` shapes
each host's egress so), ``b`` bytes take ``t(b) = 8 b / link_gbit`` ns. A step's embedding
exchange is ``E`` bytes per host (the bubble report's ``exchange_bytes_per_step``: a rank's ids
sent to other ranks, their rows back and their gradients out, mean over the ranks; one rank per
host), in two parts:

- the collision exchange, ``X`` bytes (``collision_bytes_per_step``): batch i's gradients of the
  rows batch i+1 reads, then those rows, updated, to batch i+1's readers. The gradients exist
  once batch i's backward has made them and batch i+1's forward starts by reading the rows, so
  it crosses the link between two computations in any schedule: exposed in full;
- the rest, ``E - X`` (the ids, the rows batch i does not write, the other gradients), can cross
  while the rank computes; only what exceeds the step's compute ``C`` (``compute_ms_per_step``)
  is exposed.

    bound = t(X) + max(0, t(E - X) - C)

It is a floor under the bubble report's exposed communication, not an estimate of it: it leaves
out the link's latency, the dense all-reduce and the balancer's exchanges, what a schedule sends
of its own (the prioritized pipeline's flags, the zeroed rows of its deferred gradients), and
the imbalance between hosts (``E`` and ``X`` are means over them). One assumption runs the
other way: the dense optimizer's step, which could run beside the collision exchange, is small
next to it. ``exposed - bound`` is then how far a pipeline is from what its link allows.

The bytes are the batches': every pipeline that trains the same batches exchanges the same
ones. ``add_bounds`` gives a run that recorded none (TorchRec's pipelines record no bytes,
``sync`` no collision split) the mean of those of the same batches that did.
"""

from __future__ import annotations

BYTE_KEYS = ("exchange_bytes", "collision_bytes")
"""A run's bytes per step and host (the bubble report's ``<key>_per_step``)."""


def link_ms(nbytes: float, link_gbit: float) -> float:
    """Milliseconds ``nbytes`` take on a link of ``link_gbit`` Gbit/s."""
    return nbytes * 8 / (link_gbit * 1e6)


def exposed_comm_bound_ms(exchange_bytes: float, collision_bytes: float, compute_ms: float, link_gbit: float) -> float:
    """``t(X) + max(0, t(E - X) - C)``: the exposed communication no schedule goes under (ms per
    step), for ``exchange_bytes`` E of which ``collision_bytes`` X per step and host, ``compute_ms``
    C per step, on a link of ``link_gbit`` Gbit/s per host."""
    if link_gbit <= 0:
        raise ValueError(f"link rate: expected a positive Gbit/s, got {link_gbit}")
    collision = link_ms(collision_bytes, link_gbit)
    rest = link_ms(max(exchange_bytes - collision_bytes, 0.0), link_gbit)
    return collision + max(0.0, rest - compute_ms)


def add_bounds(runs: list[dict], link_gbit: float | None) -> None:
    """Set ``bound_ms`` and ``exposed_minus_bound_ms`` on each of ``runs``, runs of the same batches
    (dicts with ``exposed_comm_ms``, ``compute_ms`` and the ``BYTE_KEYS``, None where the run
    recorded none). A run without bytes of a kind takes the mean of the runs that have them
    (``bytes_borrowed`` says so). None where there is no link (``link_gbit`` None) or no run
    recorded the bytes."""
    recorded = {key: [r[key] for r in runs if r.get(key) is not None] for key in BYTE_KEYS}
    shared = {key: sum(v) / len(v) if v else None for key, v in recorded.items()}
    for run in runs:
        borrowed = [key for key in BYTE_KEYS if run.get(key) is None]
        run.update({key: shared[key] for key in borrowed}, bytes_borrowed=bool(borrowed))
        if link_gbit is None or any(run[key] is None for key in BYTE_KEYS):
            run["bound_ms"] = run["exposed_minus_bound_ms"] = None
            continue
        bound = exposed_comm_bound_ms(run["exchange_bytes"], run["collision_bytes"], run["compute_ms"], link_gbit)
        run["bound_ms"] = round(bound, 3)
        run["exposed_minus_bound_ms"] = round(run["exposed_comm_ms"] - bound, 3)
