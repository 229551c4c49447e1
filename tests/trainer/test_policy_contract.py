"""``Policy`` (the trainer's view of the model): the Megatron policy and the test fake both follow it."""

from __future__ import annotations

import inspect

from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
from gtpo_megatron.policy import Policy
from tests.trainer.fakes import FakePolicy

METHODS = [name for name in vars(Policy) if not name.startswith("_")]


def test_protocol_lists_what_the_trainer_calls():
    assert sorted(METHODS) == [
        "compute_logprobs",
        "iter_hf_weights",
        "load_checkpoint",
        "offload_train_state",
        "restore_train_state",
        "save_checkpoint",
        "train_step",
    ]


def test_megatron_policy_and_fake_follow_the_protocol():
    assert isinstance(FakePolicy(), Policy)
    for name in METHODS:
        expected = list(inspect.signature(getattr(Policy, name)).parameters)
        for impl in (MegatronPolicy, FakePolicy):
            assert list(inspect.signature(getattr(impl, name)).parameters) == expected, (impl.__name__, name)
