"""The only package that knows Megatron-Core's calling conventions (docs/algorithm.md section 1 training step).

Modules: ``settings`` (``PolicySettings``: what the run hands Megatron, resolved once from the config sections;
torch-free, ``gtpo-plan`` reads it too), ``cpu_compat`` (CPU shim, inert on GPU), ``model`` (``TransformerConfig``
and GPTModel from the settings and an HF config), ``hf_features``
(what each HF config field does to the math: mapped or refused), ``hf_conversion``
(HF <-> Megatron shard layout and sharded loading), ``forward_step`` (schedule hook and loss closure),
``loss_forms`` (the loss in Megatron's per-token and legacy conventions, for the plugin), ``external_model`` (a
caller's GPTModel checked against the converter), ``external_checkpoint`` (a Megatron-LM checkpoint's weights),
``optimizer`` (DDP and optimizer configs, Megatron Adam, LR schedule, non-finite guard), ``step_metrics``
(metric reduction),
``hf_stream`` (streams ``(hf_name, full_tensor)`` out of the TP/PP shards: the source of weight export and weight
sync), ``hf_export`` (HF folder writer), ``checkpoint`` (Megatron dist checkpointing), ``policy``
(``MegatronPolicy``, the facade the trainer uses).
Importing this package does not import megatron.
"""

from __future__ import annotations

__all__ = ["MegatronPolicy"]


def __getattr__(name: str):
    if name == "MegatronPolicy":
        from gtpo_megatron.megatron_adapter.policy import MegatronPolicy

        return MegatronPolicy
    raise AttributeError(name)
