"""Which weight-sync path a run takes (:func:`sync_rules`; ``auto``: the first of :data:`AUTO_ORDER` that applies).

An explicit path a setting rules out is refused naming it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from gtpo_megatron.config.checks import require

if TYPE_CHECKING:
    from gtpo_megatron.config.rollout import RolloutConfig
    from gtpo_megatron.config.run import GTPOConfig

SyncPath = Literal["collective", "sharded", "files"]
AUTO_ORDER: tuple[SyncPath, ...] = ("sharded", "collective")
"""``rollout.weight_sync: auto``'s preference: the first path no setting rules out (every rule allows collective)."""


@dataclass(frozen=True, slots=True)
class SyncRule:
    """A ``setting`` that leaves ``allowed`` paths only; the other fields are ``checks.require``'s."""

    setting: str
    field: str
    value: object
    allowed: tuple[SyncPath, ...]
    why: str
    fix: str


def sync_rules(rollout: RolloutConfig, *, accelerator: bool | None = None) -> list[SyncRule]:
    """The rules of ``rollout``'s settings (module docstring); ``accelerator`` None: that rule left out."""
    sync, rules = rollout.weight_sync, []
    if rollout.num_engines not in ("auto", 1):
        rules.append(SyncRule(
            f"rollout.num_engines={rollout.num_engines}", "rollout.weight_sync", sync, ("sharded", "collective"),
            f"the files path feeds one engine, not rollout.num_engines={rollout.num_engines}",
            "use rollout.weight_sync=collective or rollout.num_engines=1",
        ))  # fmt: skip
    if rollout.fault_tolerance:
        rules.append(SyncRule(
            "rollout.fault_tolerance", "rollout.fault_tolerance/rollout.weight_sync", (True, sync), ("collective",),
            "a restarted engine rejoins through the collective weight group (files feeds one engine; sharded's "
            "point-to-point waits cannot stop for a dead engine before rollout.timeout_s)",
            "set rollout.weight_sync=collective",
        ))  # fmt: skip
    if accelerator:
        rules.append(SyncRule(
            "GPUs", "rollout.weight_sync", sync, ("collective", "files"),
            "its wire is gloo over TCP, tested with CPU engines only (no NCCL path yet)",
            "on GPUs use rollout.weight_sync=collective",
        ))  # fmt: skip
    return rules


@dataclass(frozen=True, slots=True)
class SyncChoice:
    """The path a run takes and why: ``set`` (explicit), ``auto`` or ``auto: <the settings that ruled sharded out>``."""

    path: SyncPath
    reason: str

    def describe(self) -> str:
        """``rollout.weight_sync=<path> (<reason>)``, the line start-up logs once."""
        return f"rollout.weight_sync={self.path} ({self.reason})"


def choose_weight_sync(rollout: RolloutConfig, *, accelerator: bool | None = None) -> SyncChoice:
    """The path of ``rollout`` given what is known (:func:`sync_rules`); pure.

    Raises:
        ValueError: an explicit path a rule rules out (naming the setting, why and the fix).
    """
    rules = sync_rules(rollout, accelerator=accelerator)
    if rollout.weight_sync != "auto":
        for rule in rules:
            require(rollout.weight_sync in rule.allowed, rule.field, rule.value, rule.why, rule.fix)
        return SyncChoice(rollout.weight_sync, "set")
    left = [path for path in AUTO_ORDER if all(path in rule.allowed for rule in rules)]  # collective at least
    if left[0] == AUTO_ORDER[0]:
        return SyncChoice(left[0], "auto")
    against = [rule.setting for rule in rules if AUTO_ORDER[0] not in rule.allowed]
    return SyncChoice(left[0], f"auto: sharded does not apply with {', '.join(against)}")


def run_weight_sync(cfg: GTPOConfig, *, accelerator: bool) -> SyncChoice:
    """:func:`choose_weight_sync` of a run once the accelerator is known (start-up, ``gtpo-plan``)."""
    return choose_weight_sync(cfg.rollout, accelerator=accelerator)


def with_weight_sync(cfg: GTPOConfig, choice: SyncChoice) -> GTPOConfig:
    """``cfg`` with ``rollout.weight_sync`` set to ``choice.path`` (what the run's components then read)."""
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, weight_sync=choice.path))
