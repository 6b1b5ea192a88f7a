"""What survives a restart, as ``Stateful`` parts: model, optimizers, trainer counters, the data
cursor and the RNG.

``TrainingState.parts`` is a dict of parts, each with ``state_dict()`` / ``load_state_dict()``.
``torch.distributed.checkpoint`` takes that dict as it is (it calls both methods on each part),
and a live transfer between replicas can take ``TrainingState.state_dict()`` and give it to
``load_state_dict()`` on the other side. Counters are int64 tensors, not ints: DCP keeps
tensors in place on both save and load.
"""

from __future__ import annotations

import torch

from freescale.model.sharding import init_dense_state


class ModelState:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def state_dict(self) -> dict:
        return self.model.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state)


class OptimizerState:
    """The combined optimizer (fused embedding + dense). Before a load, the dense optimizer's
    lazy state must exist to be loaded into: ``prepare_load`` makes it (a step with zero
    gradients, whose effect the load then overwrites)."""

    def __init__(self, optimizer) -> None:
        self.optimizer = optimizer

    def prepare_load(self) -> None:
        init_dense_state(self.optimizer)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class TrainerState:
    """The number of optimizer steps taken."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": torch.tensor(self.step, dtype=torch.int64)}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])


class DataCursor:
    """The next batch to train of this group's shard of the stream; under the replica layer,
    every group's.

    Pipelines and the balancer read batches ahead of training, so the cursor follows the
    batches *trained* (``advance_past``), not the loader's read position.

    With several replica groups (``groups`` > 1) the cursor holds every group's next batch,
    one slot per group, and travels with the model state: each committed step brings every
    other group's cursor as that step left it (``freescale.ft.row_exchange``), so a group
    that takes a peer's state (catch-up) or a checkpoint takes, with it, exactly which of its
    own batches that state has trained.
    """

    def __init__(self, loader, groups: int = 1) -> None:
        self.loader = loader
        self.shard = loader.shard if groups > 1 else 0
        self.positions = [0] * groups
        self.positions[self.shard] = loader.next_batch

    @property
    def next_batch(self) -> int:
        return self.positions[self.shard]

    def stream(self):
        """The loader's (batch index, samples) from the cursor on. Loading a state afterwards
        leaves the stream where it is (a group that catches up mid-run keeps the batches its
        pipeline holds)."""
        self.loader.load_state_dict({"next_batch": self.next_batch})
        return self.loader.iter_samples()

    def advance_past(self, batch_index: int) -> None:
        self.positions[self.shard] = self.loader.position_after(batch_index)

    def state_dict(self) -> dict:
        state = {"next_batch": torch.tensor(self.next_batch, dtype=torch.int64)}
        if len(self.positions) > 1:
            state["groups"] = torch.tensor(self.positions, dtype=torch.int64)
        return state

    def load_state_dict(self, state: dict) -> None:
        if "groups" in state:
            positions = [int(p) for p in state["groups"]]
            if len(positions) != len(self.positions):
                raise ValueError(f"the state holds data cursors of {len(positions)} replica group(s), "
                                 f"this job has {len(self.positions)} (ft.num_replicas)")
            self.positions = positions
        else:
            self.positions[self.shard] = int(state["next_batch"])


class RNGState:
    """This rank's CPU random generator, under a key of its own (ranks draw different streams)."""

    def __init__(self, rank: int) -> None:
        self.key = f"rank{rank}"

    def state_dict(self) -> dict:
        return {self.key: torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state[self.key])


class TrainingState:
    """The parts by name (``parts``): ``model``, ``optimizer``, ``trainer``, ``data``, ``rng``."""

    def __init__(self, *, model, optimizer, trainer: TrainerState, data: DataCursor, rng: RNGState) -> None:
        self.parts = {"model": ModelState(model), "optimizer": OptimizerState(optimizer), "trainer": trainer,
                      "data": data, "rng": rng}

    def prepare_load(self) -> None:
        """Make the state that is created lazily, so that a load has somewhere to go (DCP loads
        in place into what ``state_dict()`` returns)."""
        self.parts["optimizer"].prepare_load()

    def state_dict(self) -> dict:
        return {name: part.state_dict() for name, part in self.parts.items()}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (another replica's ``state_dict()``), into a freshly built state too."""
        self.prepare_load()  # whatever it changes, the parts loaded below overwrite
        for name, part in self.parts.items():
            part.load_state_dict(state[name])
