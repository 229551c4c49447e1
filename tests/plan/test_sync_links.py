"""``plan.sync_links``: the busiest link of each weight-sync path, by hand for small layouts and the recipes."""

from __future__ import annotations

import pytest

from gtpo_megatron.plan.sync_links import sync_links
from gtpo_megatron.plan_cli import run
from tests.plan.test_cli import CONFIGS


def test_links_by_hand():
    # 8 GB over 4 training ranks to 2 engines x TP 2 at 64 Gbit/s (8 GB/s): each worker takes its half
    links = sync_links(8e9, train_ranks=4, num_engines=2, engine_tp_size=2, bandwidth_gbps=64)
    assert (links["collective"].sender_bytes, links["collective"].receiver_bytes) == (8e9, 8e9)
    assert links["collective"].seconds == pytest.approx(1.0)
    assert (links["sharded"].sender_bytes, links["sharded"].receiver_bytes) == (4e9, 4e9)
    assert links["sharded"].seconds == pytest.approx(0.5)
    # engine TP 1, fewer workers than ranks: the sharded sender carries 8 GB * 2 / 4, each worker the whole model
    one = sync_links(8e9, train_ranks=4, num_engines=2, engine_tp_size=1, bandwidth_gbps=64)["sharded"]
    assert (one.sender_bytes, one.receiver_bytes, one.seconds) == (4e9, 8e9, pytest.approx(1.0))
    with pytest.raises(ValueError, match="train_ranks=0"):
        sync_links(1.0, train_ranks=0, num_engines=1, engine_tp_size=1, bandwidth_gbps=1)


@pytest.mark.parametrize(
    "recipe, gpus, expected",
    [
        ("llama3.1-70b_math_gtpo_32gpu.yaml", "32", "collective 141.1 GB out of the busiest sender, 141.1 GB into each "
         "worker, 2.82 s; sharded 17.6 GB out of the busiest sender, 17.6 GB into each worker, 0.35 s"),
        ("qwen3-30b-a3b_math_gtpo_32gpu.yaml", "32", "collective 61.1 GB out of the busiest sender, 61.1 GB into each "
         "worker, 1.22 s; sharded 7.6 GB out of the busiest sender, 7.6 GB into each "
         "worker, 0.15 s"),
        ("qwen3-235b-a22b_math_gtpo_64gpu.yaml", "64", "collective 470.2 GB out of the busiest sender, 470.2 GB into "
         "each worker, 9.40 s; sharded 58.8 GB out of the busiest sender, 58.8 GB into each worker, 1.18 s"),
    ],
)  # fmt: skip
def test_the_recipes_side_by_side(recipe, gpus, expected):
    status, text = run(["--config", str(CONFIGS / recipe), "--gpus", gpus, "--gpu-mem", "80"])
    assert status == 0, text
    assert expected in text
