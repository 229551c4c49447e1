"""``FrozenReference``'s optional host offload between passes, with a stand-in policy (no Megatron, no CUDA)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gtpo_megatron.megatron_adapter.reference import FrozenReference


class _Model:
    def __init__(self, events):
        self.events = events

    def to(self, device):
        self.events.append(f"to {device}")
        return self


def _policy(device: str, events: list[str]):
    def compute_logprobs(batch, *, temperature, entropy_temperature):
        events.append(f"pass T={temperature} T_H={entropy_temperature}")
        return torch.zeros(1), torch.zeros(1)

    return SimpleNamespace(device=torch.device(device), model=_Model(events), compute_logprobs=compute_logprobs)


def test_offload_moves_the_weights_around_each_pass_on_cuda():
    events: list[str] = []
    reference = FrozenReference(_policy("cuda", events), offload=True)
    reference.compute_logprobs(None, temperature=0.9)
    assert events == ["to cpu", "to cuda", "pass T=0.9 T_H=None", "to cpu"]


def test_offload_is_a_no_op_on_cpu_and_off_by_default():
    for device, offload in (("cpu", True), ("cuda", False)):
        events: list[str] = []
        FrozenReference(_policy(device, events), offload=offload).compute_logprobs(None, temperature=1.0)
        assert events == ["pass T=1.0 T_H=None"]
