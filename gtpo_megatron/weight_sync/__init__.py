"""Trainer -> rollout weight transfer: stream full HF-named tensors out of the sharded Megatron policy.

``iter_hf_weights`` (in ``gather``) is the single source of HF tensors: ``MegatronPolicy.iter_hf_weights``,
HF folder export and any rollout-engine push consume it. Importing this package does not import megatron.
"""

from __future__ import annotations

__all__ = ["iter_hf_weights"]


def __getattr__(name: str):
    if name == "iter_hf_weights":
        from gtpo_megatron.weight_sync.gather import iter_hf_weights

        return iter_hf_weights
    raise AttributeError(name)
