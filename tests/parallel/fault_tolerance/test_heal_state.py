"""What a heal carries (parallel/fault_tolerance/replica.HealState): a rank that receives a live rank's state runs
the very step the live rank runs next: same batch (the step's), same dropout masks (CPU, tensor-parallel and, on
CUDA, the device generator's streams), same update; the CUDA generator travels when the device is CUDA."""

from __future__ import annotations

import io

import torch

from recipe_helpers import tiny_recipe

from megazoo.parallel import accelerator
from megazoo.parallel.topology import Topology
from megazoo.recipes.resolve import resolve
from megazoo.recipes.training.replicated import heal_state
from megazoo.recipes.training.trainer import Trainer

DROPOUT = {"model": {"dropout": 0.2, "attn_dropout": 0.2},
           "parallel": {"dp": 2}, "fault_tolerance": {"enabled": True, "replica_groups": 2}}


def _trainer() -> Trainer:  # replica group 1 of 2, one rank: the group's share of each global batch
    return Trainer(resolve(tiny_recipe(**DROPOUT), world_size=1), Topology.solo(), replica_group=1)


def _sent(state: dict) -> dict:
    """Through bytes, as torchft's HTTP transport sends it: nothing shared with the sender."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _views(trainer: Trainer) -> list[torch.Tensor]:
    return [v.tensor.clone() for v in trainer.zero.state_views()]


def test_a_healed_rank_runs_the_step_the_live_rank_runs():
    live = _trainer()
    for step in range(3):
        live.train_step(step)
    sent = _sent(heal_state(live).state_dict())
    want, live_views = live.train_step(3), _views(live)
    # one process: the CPU generator is shared, so each receiver loads the state just before its own step
    healed = _trainer()
    heal_state(healed).load_state_dict(sent)
    got = healed.train_step(3)
    assert got["loss"] == want["loss"] and got["grad_norm"] == want["grad_norm"]
    assert all(torch.equal(a, b) for a, b in zip(live_views, _views(healed)))  # the same update, bit for bit
    assert torch.equal(healed.model.rng.get_state(), live.model.rng.get_state())  # the tp stream goes on alike
    stale = _trainer()
    without_tp = heal_state(stale)
    without_tp.tp_rng = None  # what the heal carried before: the CPU generator only
    without_tp.load_state_dict(sent)
    assert stale.train_step(3)["loss"] != want["loss"]  # the attention's masks come from the tp stream


class _Generators(accelerator.CudaRuntime):
    """A CUDA runtime with a generator state per device and nothing else (a call to anything else fails)."""

    def __init__(self):
        self.states: dict[int, torch.Tensor] = {}

    def get_rng_state(self, device: torch.device) -> torch.Tensor:
        return self.states[device.index].clone()

    def set_rng_state(self, state: torch.Tensor, device: torch.device) -> None:
        self.states[device.index] = state.clone()


def test_on_cuda_the_device_generator_travels_with_the_heal():
    cuda = torch.device("cuda", 1)
    sender, receiver = _trainer(), _trainer()
    runtime = _Generators()
    with accelerator.using_runtime(runtime):
        runtime.states[1] = torch.arange(16, dtype=torch.uint8)
        send = heal_state(sender)
        send.device = cuda
        state = _sent(send.state_dict())
        assert torch.equal(state["rng"]["cuda"], torch.arange(16, dtype=torch.uint8))
        runtime.states[1] = torch.zeros(16, dtype=torch.uint8)  # the receiver's own stream, elsewhere
        receive = heal_state(receiver)
        receive.device = cuda
        receive.load_state_dict(state)
        assert torch.equal(runtime.states[1], torch.arange(16, dtype=torch.uint8))
    assert torch.equal(torch.get_rng_state(), state["rng"]["cpu"])
