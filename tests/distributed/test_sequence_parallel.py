"""``parallel.sequence_parallel`` reaches the running model and changes no number (2 gloo ranks, TP=2).

The same tiny-llama policy is built with and without Megatron sequence parallelism (the sequence split over the TP
ranks between the tensor-parallel regions) on a batch of 13 columns, which the policy pads to a multiple of
``tp_size`` for the split; the log-probs, entropies, the step's loss and every parameter's gradient must agree (the
norms' gradients only when their partial sums over the sequence slices are summed over TP).
"""

from __future__ import annotations

import pytest

from gtpo_megatron.ops import LossSpec
from tests.adapter.megatron_helpers import TINY_LLAMA, make_batch, model_section, settings_at
from tests.helpers.dist_harness import run_distributed

pytestmark = pytest.mark.distributed
LOSS = LossSpec(loss_name="gtpo", aggregation="seq-mean-token-mean", clip_eps_low=0.2, clip_eps_high=0.2)


def _with_and_without(rank: int, world_size: int) -> None:
    import torch

    from gtpo_megatron.megatron_adapter.policy import MegatronPolicy
    from gtpo_megatron.parallel.groups import init_distributed

    groups = init_distributed(tp_size=2, pp_size=1)
    batch = make_batch(rows=4, seq_len=13, seed=3)
    runs = []
    for sequence_parallel in (False, True):
        settings = settings_at(groups, model_section(TINY_LLAMA), sequence_parallel=sequence_parallel,
                               micro_batch_size=2)  # fmt: skip
        policy = MegatronPolicy.from_pretrained(settings, groups=groups)
        assert policy.model.config.sequence_parallel is sequence_parallel
        logprobs, entropy = policy.compute_logprobs(batch)
        assert logprobs.shape == batch.input_ids.shape
        loss = policy.forward_backward(batch, LOSS)["loss"]
        grads = {name: p.main_grad.clone() for name, p in policy.model.named_parameters()}
        runs.append((logprobs, entropy, loss, grads))
    (logprobs, entropy, loss, grads), (sp_logprobs, sp_entropy, sp_loss, sp_grads) = runs
    torch.testing.assert_close(sp_logprobs, logprobs, atol=1e-5, rtol=0)
    torch.testing.assert_close(sp_entropy, entropy, atol=5e-5, rtol=0)
    assert abs(sp_loss - loss) <= 1e-5 * (1 + abs(loss)), (sp_loss, loss)
    assert sp_grads.keys() == grads.keys() and any("layernorm" in name for name in grads)
    for name, grad in grads.items():
        torch.testing.assert_close(sp_grads[name], grad, atol=1e-5, rtol=1e-4, msg=lambda m, n=name: f"{n}: {m}")


def test_config_wiring_sequence_parallel_reaches_the_model_and_changes_nothing():
    run_distributed(_with_and_without, 2)
