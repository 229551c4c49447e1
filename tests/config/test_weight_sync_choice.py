"""``rollout.weight_sync``: ``auto`` takes sharded wherever it applies and falls back where a setting rules it out;
an explicit ``sharded`` there is refused naming the setting (``config/weight_sync.py``)."""

from __future__ import annotations

import pytest

from gtpo_megatron.config import load_config
from gtpo_megatron.config.weight_sync import choose_weight_sync, run_weight_sync, sync_rules, with_weight_sync

BASE = ["model=builtin:tiny-llama", "output_dir=/tmp/unused"]
PARTIAL = [
    "rollout.partial_rollouts=true",
    "rollout.mode=async",
    "rollout.placement=separate",
    "algorithm.off_policy_correction=tis",
]
FAULTS = ["rollout.fault_tolerance=true", "rollout.num_engines=2"]


def test_the_default_is_auto_and_takes_sharded_on_cpu_and_collective_on_gpus():
    cfg = load_config(None, BASE)
    assert cfg.rollout.weight_sync == "auto"
    cpu, gpu = run_weight_sync(cfg, accelerator=False), run_weight_sync(cfg, accelerator=True)
    assert (cpu.path, cpu.reason) == ("sharded", "auto")
    assert (gpu.path, gpu.reason) == ("collective", "auto: sharded does not apply with GPUs")
    assert gpu.describe() == "rollout.weight_sync=collective (auto: sharded does not apply with GPUs)"
    resolved = with_weight_sync(cfg, cpu)
    assert resolved.rollout.weight_sync == "sharded" and resolved.model == cfg.model


@pytest.mark.parametrize(
    ("overrides", "path", "setting"),
    [
        (FAULTS, "collective", "rollout.fault_tolerance"),
    ],
)
def test_auto_falls_back_where_sharded_is_refused(overrides, path, setting):
    cfg = load_config(None, [*BASE, *overrides])
    cfg.validate(2)  # auto passes every check an explicit sharded fails
    choice = run_weight_sync(cfg, accelerator=False)
    assert (choice.path, choice.reason) == (path, f"auto: sharded does not apply with {setting}")
    with_weight_sync(cfg, choice).validate(2)  # the resolved config passes the same checks


@pytest.mark.parametrize(
    ("overrides", "accelerator", "message"),
    [
        (FAULTS, False, r"rollout.fault_tolerance/rollout.weight_sync=\(True, 'sharded'\): a restarted engine "
                        r"rejoins .*set rollout.weight_sync=collective"),
        ([], True, r"rollout.weight_sync='sharded': its wire is gloo over TCP.*on GPUs use "
                   r"rollout.weight_sync=collective"),
    ],
)  # fmt: skip
def test_an_explicit_sharded_is_still_refused_naming_why(overrides, accelerator, message):
    with pytest.raises(ValueError, match=message):
        cfg = load_config(None, [*BASE, *overrides, "rollout.weight_sync=sharded"])
        cfg.validate(2)
        run_weight_sync(cfg, accelerator=accelerator)


def test_explicit_paths_stay_as_they_are():
    for path in ("collective", "sharded", "files"):
        choice = run_weight_sync(load_config(None, [*BASE, f"rollout.weight_sync={path}"]), accelerator=False)
        assert (choice.path, choice.reason) == (path, "set")
    gpu = run_weight_sync(load_config(None, [*BASE, "rollout.weight_sync=files"]), accelerator=True)
    assert gpu.path == "files"


def test_every_rule_leaves_collective_so_auto_always_has_a_path():
    everything = [*BASE, *PARTIAL, *FAULTS, "model.lora.rank=4"]
    rules = sync_rules(load_config(None, everything).rollout, accelerator=True)
    assert len(rules) == 3 and all("collective" in rule.allowed for rule in rules)
    assert choose_weight_sync(load_config(None, everything).rollout, accelerator=True).path == "collective"
    # a rule whose input is not known yet waits: the accelerator before start-up
    rollout = load_config(None, BASE).rollout
    assert choose_weight_sync(rollout).path == "sharded"
    assert choose_weight_sync(rollout, accelerator=True).path == "collective"


def test_merged_lora_takes_the_sharded_path():
    cfg = load_config(None, [*BASE, "model.lora.rank=4"])
    cfg.validate(2)
    assert run_weight_sync(cfg, accelerator=False).path == "sharded"  # each rank sends its merged shards
