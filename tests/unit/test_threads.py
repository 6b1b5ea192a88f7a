"""A rank's intra-op threads come from the cores it may run on, not the machine's count."""

import os

import pytest
import torch

from freescale import distributed, env


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a process allowed on two cores or more")
def test_a_rank_pinned_to_one_core_computes_on_one_thread():
    # A host of one core (taskset, a cgroup cpuset, a pinned container) on a machine of several:
    # two threads there take turns on the core and slow every kernel down.
    allowed, before = os.sched_getaffinity(0), torch.get_num_threads()
    try:
        os.sched_setaffinity(0, {min(allowed)})
        assert env.cores() == 1
        assert distributed.set_threads(0, local_world_size=1) == 1
        assert torch.get_num_threads() == 1
        os.sched_setaffinity(0, set(sorted(allowed)[:2]))
        assert distributed.set_threads(0, local_world_size=1) == 2
        assert distributed.set_threads(0, local_world_size=2) == 1
        assert distributed.set_threads(3, local_world_size=2) == 3  # a count asked for is taken as is
    finally:
        os.sched_setaffinity(0, allowed)
        torch.set_num_threads(before)
