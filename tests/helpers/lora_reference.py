"""A hand-written float64 LoRA on a ``transformers`` model, and the TP shards of its adapters (shares no code with
``gtpo_megatron.megatron_adapter.lora``).

Each targeted ``nn.Linear`` (``model.layers.{i}.self_attn.q_proj`` ...) gets ``y += scale * (x @ A.T) @ B.T`` from a
forward hook, with ``A`` ``[r, in]`` and ``B`` ``[out, r]`` leaf tensors (peft's layout and formula). Shards follow
Megatron's tensor parallelism written out by hand: q/k/v, gate and up are column-parallel (``B`` rows split in
contiguous blocks, ``A`` whole), o_proj and down_proj row-parallel (``A`` columns split, ``B`` whole).
"""

from __future__ import annotations

import torch

PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
          "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}  # fmt: skip
ROW_PARALLEL = ("o_proj", "down_proj")


def random_adapters(hf_model, projections, rank: int, *, seed: int = 0) -> dict[tuple[int, str], tuple]:
    """``{(layer, proj): (A, B)}`` float64 leaf tensors requiring grad, both random (B too, so gradients reach A)."""
    gen = torch.Generator().manual_seed(seed)
    adapters = {}
    for index, layer in enumerate(hf_model.model.layers):
        for proj in projections:
            linear = getattr(getattr(layer, PARENT[proj]), proj)
            a = (torch.randn(rank, linear.in_features, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
            b = (torch.randn(linear.out_features, rank, generator=gen, dtype=torch.float64) * 0.1).requires_grad_()
            adapters[(index, proj)] = (a, b)
    return adapters


def add_lora(hf_model, adapters, scale: float) -> list:
    """Hook ``adapters`` onto ``hf_model`` (float64); returns the hook handles."""
    handles = []
    for (index, proj), (a, b) in adapters.items():
        linear = getattr(getattr(hf_model.model.layers[index], PARENT[proj]), proj)

        def hook(module, args, output, a=a, b=b):
            return output + scale * (args[0] @ a.T) @ b.T

        handles.append(linear.register_forward_hook(hook))
    return handles


def merged_hf_weights(hf_model, adapters, scale: float) -> dict[str, torch.Tensor]:
    """``{hf_name: W + scale * B @ A}`` of every targeted projection's weight, float64."""
    merged = {}
    for (index, proj), (a, b) in adapters.items():
        linear = getattr(getattr(hf_model.model.layers[index], PARENT[proj]), proj)
        merged[f"model.layers.{index}.{PARENT[proj]}.{proj}.weight"] = linear.weight.double() + scale * b @ a
    return merged


def shard(tensor: torch.Tensor, proj: str, which: str, tp_rank: int, tp_size: int) -> torch.Tensor:
    """This TP rank's part of ``A`` (``which="A"``) or ``B`` of projection ``proj`` (or of its gradient)."""
    if which == "A" and proj in ROW_PARALLEL:
        return tensor.chunk(tp_size, dim=1)[tp_rank]
    if which == "B" and proj not in ROW_PARALLEL:
        return tensor.chunk(tp_size, dim=0)[tp_rank]
    return tensor
