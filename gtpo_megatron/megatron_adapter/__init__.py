"""The only package that knows Megatron-Core's calling conventions: model, HF conversion, loss, optimizer, checkpoints.

``policy.MegatronPolicy`` is the facade the trainer uses; docs/architecture.md lists the modules. Importing this
package does not import megatron.
"""

from __future__ import annotations

__all__ = ["MegatronPolicy"]


def __getattr__(name: str):
    if name == "MegatronPolicy":
        from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)
