"""gtpo_megatron: GTPO (Simoni et al., TACL 2026) for Megatron-Core with vLLM rollouts.

The plugin API for existing Megatron pipelines (``gtpo_megatron.plugin``) is re-exported here:
``from gtpo_megatron import compute_gtpo_weights, per_token_loss, make_forward_step, sync_weights``. The names are
resolved on first use, so importing this package imports neither torch, megatron nor vllm (nor does importing any
of its light subpackages, e.g. ``gtpo_megatron.rewards``); ``gtpo_megatron.plugin`` itself imports torch only.
"""

__version__ = "0.1.0"

_PLUGIN_NAMES = frozenset(
    {
        "AlgorithmConfig",
        "ForwardSettings",
        "LoRAConfig",
        "LossSpec",
        "MicroBatch",
        "PackedLayout",
        "ParallelGroups",
        "PushStats",
        "RolloutConfig",
        "StepWeights",
        "attach_lora",
        "build_loss_spec",
        "compute_gtpo_weights",
        "cuda_to_cpu_mode",
        "current_groups",
        "init_distributed",
        "install_cpu_compat",
        "legacy_loss",
        "legacy_loss_from_logprobs",
        "loss_normalizer",
        "forward_settings",
        "make_forward_step",
        "per_token_loss",
        "per_token_loss_from_logprobs",
        "reduce_loss_metrics",
        "save_adapters",
        "sequence_mean_entropy",
        "sync_weights",
        "token_logprobs_entropy",
    }
)


def __getattr__(name: str):
    if name in _PLUGIN_NAMES:
        from gtpo_megatron import plugin

        return getattr(plugin, name)
    raise AttributeError(f"module 'gtpo_megatron' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_PLUGIN_NAMES})
