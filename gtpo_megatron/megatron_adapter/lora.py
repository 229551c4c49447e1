"""Low-rank adapters on a Megatron ``GPTModel`` stage's fused linears, one per targeted HF projection.

Megatron fuses q/k/v into ``linear_qkv`` and gate/up into ``linear_fc1``; each targeted HF projection keeps its own
``A`` ``[r, in]`` and ``B`` ``[out, r]`` (peft's layout), and the adapters' outputs are laid out as the fused
linear's output rows (``hf_conversion``'s qkv group interleave, fc1's ``[gate; up]`` shard), zeros for a projection
without one. An adapter is a sibling module of its linear (``self_attention.linear_qkv_lora``), added to the
linear's output by a forward hook; the base weights are frozen. Tensor parallelism (docs/algorithm.md section 6):

* column-parallel (linear_qkv, linear_fc1): ``A`` replicated, ``B`` split on its output rows as the linear's are.
  ``x @ A.T`` is ``[S, b, r]``: Megatron's ``copy_to_tensor_model_parallel_region`` (backward: TP all-reduce) or,
  with sequence parallelism, ``gather_from_sequence_parallel_region`` of the local sequence slice;
* row-parallel (linear_proj, linear_fc2): ``A`` split on its input columns, ``B`` replicated; the partial
  ``x @ A.T`` is summed by ``reduce_from_tensor_model_parallel_region`` or, with sequence parallelism,
  ``reduce_scatter_to_sequence_parallel_region``.

Replicated adapters computed on a sequence slice carry ``sequence_parallel`` (``finalize_model_grads`` sums their
gradients over TP); split ones carry Megatron's tensor-parallel attributes (gradient norm, checkpoint axis).
``A`` is drawn from a generator seeded by the seed and the global name, on the full shape then sliced, so every
layout starts from the same adapters.
"""

from __future__ import annotations

import contextlib
import math
import zlib
from dataclasses import dataclass

import torch

from gtpo_megatron.config.lora import LoRAConfig

_LINEARS = {  # Megatron linear -> (parent, its HF projections in output order, row-parallel)
    "linear_qkv": ("self_attention", ("q_proj", "k_proj", "v_proj"), False),
    "linear_proj": ("self_attention", ("o_proj",), True),
    "linear_fc1": ("mlp", ("gate_proj", "up_proj"), False),
    "linear_fc2": ("mlp", ("down_proj",), True),
}
SUFFIX = "_lora"
"""A linear's adapter module is named ``<linear><SUFFIX>`` beside it (``hf_conversion`` exports none of it)."""


@dataclass(frozen=True)
class QKVLayout:
    """This rank's ``linear_qkv`` rows: ``groups`` KV groups of ``q`` query rows then ``kv`` key and value rows."""

    groups: int
    q: int
    kv: int


class LinearLoRA(torch.nn.Module):
    """The adapters of one Megatron linear on this TP rank; ``forward`` returns the output rows they add.

    ``out_sizes``: each HF projection's local output rows (its ``B`` rows); ``targets``: those with an adapter.
    """

    def __init__(self, *, linear, name: str, lora: LoRAConfig, targets: tuple[str, ...], out_sizes: dict[str, int],
                 row_parallel: bool, qkv: QKVLayout | None, seed: int) -> None:  # fmt: skip
        super().__init__()
        self.tp_group, self.tp_size = linear.tp_group, linear.tp_group.size()
        self.sequence_parallel = bool(linear.sequence_parallel)
        self.row_parallel, self.qkv, self.out_sizes = row_parallel, qkv, out_sizes
        self.scale, self.dropout = lora.scale, lora.dropout
        self.enabled = True  # False inside adapters_off: the base model's forward
        weight = linear.weight
        in_local = weight.shape[1]
        in_full = in_local * self.tp_size if row_parallel else in_local
        tp_rank = self.tp_group.rank()
        self.lora_A, self.lora_B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        for proj in targets:
            gen = torch.Generator().manual_seed(seed + zlib.crc32(f"{name}.{proj}".encode()))
            full = torch.empty(lora.rank, in_full)
            bound = 1 / math.sqrt(in_full)  # peft's kaiming_uniform_(a=sqrt(5)) bound
            full.uniform_(-bound, bound, generator=gen)
            local = full[:, tp_rank * in_local : (tp_rank + 1) * in_local] if row_parallel else full
            self.lora_A[proj] = _param(local, weight, split_dim=1 if row_parallel else None)
            b_rows = out_sizes[proj]
            self.lora_B[proj] = _param(torch.zeros(b_rows, lora.rank), weight, split_dim=None if row_parallel else 0)
        replicated = self.lora_B if row_parallel else self.lora_A
        for param in replicated.values():
            param.sequence_parallel = self.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[s, b, out_local]`` rows to add to the linear's output, from its input ``x`` ``[s', b, in_local]``.

        Collectives: one of Megatron's TP mappings per projection on ``[., b, r]`` (module docstring).
        """
        if self.dropout and self.training:
            x = torch.nn.functional.dropout(x, self.dropout)
        deltas = {proj: self._low_rank(proj, x) @ self.lora_B[proj].T for proj in self.lora_A}
        return self._assemble(deltas) * self.scale

    def _low_rank(self, proj: str, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import mappings

        low = x @ self.lora_A[proj].T
        if self.tp_size == 1:
            return low
        if self.row_parallel:
            if self.sequence_parallel:
                return mappings.reduce_scatter_to_sequence_parallel_region(low, group=self.tp_group)
            return mappings.reduce_from_tensor_model_parallel_region(low, group=self.tp_group)
        if self.sequence_parallel:
            return mappings.gather_from_sequence_parallel_region(low, group=self.tp_group)
        return mappings.copy_to_tensor_model_parallel_region(low, group=self.tp_group)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``[out_local, in_local]`` fp32: ``scale * B @ A`` in the linear's row layout (the merged weight's part)."""
        deltas = {proj: (self.lora_B[proj].float() @ self.lora_A[proj].float()).T for proj in self.lora_A}
        return (self._assemble(deltas) * self.scale).T

    def _assemble(self, deltas: dict[str, torch.Tensor]) -> torch.Tensor:
        """Each projection's ``[*L, out_p]`` laid out as the fused linear's output ``[*L, out_local]``."""
        some = next(iter(deltas.values()))
        lead = some.shape[:-1]
        parts = [deltas[p] if p in deltas else some.new_zeros(*lead, size) for p, size in self.out_sizes.items()]
        if self.qkv is None:
            return torch.cat(parts, dim=-1)
        grouped = [part.reshape(*lead, self.qkv.groups, -1) for part in parts]
        return torch.cat(grouped, dim=-1).reshape(*lead, -1)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """Megatron dist-checkpoint tensors: the split adapters sharded along their TP axis, the others replicated."""
        from megatron.core.transformer.utils import ensure_metadata_has_dp_cp_group, make_sharded_tensors_for_checkpoint

        split, axis = ("lora_A", 1) if self.row_parallel else ("lora_B", 0)
        return make_sharded_tensors_for_checkpoint(
            self.state_dict(prefix="", keep_vars=True),
            prefix,
            {f"{split}.{proj}": axis for proj in self.lora_A},
            sharded_offsets,
            tp_group=self.tp_group,
            dp_cp_group=ensure_metadata_has_dp_cp_group(metadata)["dp_cp_group"],
        )


def attach_lora(model, lora: LoRAConfig, geometry, *, seed: int) -> int:
    """Freeze this ``GPTModel`` stage and give each targeted linear its adapters; returns their parameter count.

    ``geometry``: the stage's ``hf_conversion.ModelGeometry``. Call after the base weights are loaded.

    Raises:
        ValueError: Transformer Engine layer specs (their linear_qkv/linear_fc1 fuse the norm the adapter must see),
            zero-padded KV groups (``model.pad_attention_heads``), or a targeted linear the layer lacks (an MoE
            layer's experts).
    """
    if geometry.num_pad_groups:
        raise ValueError(
            f"model.lora.rank={lora.rank} with model.pad_attention_heads=true padding {geometry.num_query_groups} KV "
            f"groups to {geometry.padded_num_query_groups}: adapters on padded heads are not built; choose a "
            "parallel.tp_size that divides the KV heads"
        )
    if getattr(model, "layer_spec_backend", "local") != "local":
        raise ValueError(
            f"model.lora.rank={lora.rank} with Transformer Engine layer specs: their linear_qkv and linear_fc1 fuse "
            "the layer norm, so the adapters would see the un-normalised input; not built. Build the model with "
            "Megatron's local specs (model.layer_spec=auto or local), or set model.lora.rank=null"
        )
    model.requires_grad_(False)
    count = 0
    for layer in model.decoder.layers:
        for linear_name, (parent_name, projections, row_parallel) in _LINEARS.items():
            targets = tuple(proj for proj in projections if proj in lora.projections)
            if not targets:
                continue
            parent = getattr(layer, parent_name)
            linear = getattr(parent, linear_name, None)
            name = f"decoder.layers.{layer.layer_number - 1}.{parent_name}.{linear_name}"
            if linear is None:
                raise ValueError(
                    f"model.lora.target_modules={lora.target_modules}: {name} does not exist (the MLP of a "
                    "mixture-of-experts layer is its experts, which get no adapters); list the attention projections"
                )
            out_sizes, qkv = _out_sizes(linear_name, linear, geometry)
            adapter = LinearLoRA(
                linear=linear, name=name, lora=lora, targets=targets, out_sizes=out_sizes,
                row_parallel=row_parallel, qkv=qkv, seed=seed,
            )  # fmt: skip
            parent.add_module(linear_name + SUFFIX, adapter)
            linear.register_forward_hook(_adding(adapter))
            count += sum(param.numel() for param in adapter.parameters())
    return count


def _out_sizes(linear_name: str, linear, geometry) -> tuple[dict[str, int], QKVLayout | None]:
    """Each HF projection's local output rows of ``linear`` and, for linear_qkv, its group layout."""
    rows = linear.weight.shape[0]
    projections = _LINEARS[linear_name][1]
    if linear_name == "linear_qkv":
        groups = geometry.padded_num_query_groups // geometry.tp_size
        layout = QKVLayout(groups, geometry.heads_per_group * geometry.head_dim, geometry.head_dim)
        return dict(zip(projections, (groups * layout.q, groups * layout.kv, groups * layout.kv))), layout
    if linear_name == "linear_fc1":
        return dict.fromkeys(projections, rows // 2), None
    return {projections[0]: rows}, None


def _adding(adapter: LinearLoRA):
    """A forward hook adding ``adapter``'s rows to a Megatron linear's ``(output, bias)``."""

    def hook(module, args, output):
        if not adapter.enabled:
            return output
        out, bias = output
        return out + adapter(args[0]).to(out.dtype), bias

    return hook


@contextlib.contextmanager
def adapters_off(model):
    """Within the block ``model``'s forwards are the base model's (every adapter skipped); no collectives."""
    adapters = [module for module in model.modules() if isinstance(module, LinearLoRA)]
    for adapter in adapters:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in adapters:
            adapter.enabled = True


def adapters_by_weight(model) -> dict[str, LinearLoRA]:
    """``{global name of a base linear's weight: its adapters}`` of this stage (``hf_stream``'s merge)."""
    from gtpo_megatron.megatron_adapter.hf_conversion import global_param_name, stage_offsets

    layer_offset, _ = stage_offsets(model)
    found = {}
    for local_name, module in model.named_modules():
        if isinstance(module, LinearLoRA):
            base = local_name[: -len(SUFFIX)] + ".weight"
            found[global_param_name(base, layer_offset)] = module
    return found


def merged_weight(param: torch.Tensor, adapter: LinearLoRA | None) -> torch.Tensor:
    """``param`` with ``adapter``'s ``delta_weight`` added in fp32, in ``param``'s dtype (``param`` if None)."""
    if adapter is None:
        return param.detach()
    return (param.detach().float() + adapter.delta_weight()).to(param.dtype)


def _param(tensor: torch.Tensor, like: torch.Tensor, *, split_dim: int | None) -> torch.nn.Parameter:
    """A trainable parameter of ``tensor`` in ``like``'s dtype and device, tagged TP-split along ``split_dim``."""
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    # contiguous: a column slice (row-parallel A) would keep its full tensor and break the fused CPU Adam
    param = torch.nn.Parameter(tensor.to(dtype=like.dtype, device=like.device).contiguous())
    if split_dim is not None:
        set_tensor_model_parallel_attributes(param, True, split_dim, 1)
    return param


def adapter_signature(model) -> dict | None:
    """``{"rank", "scale", "projections"}`` of this stage's adapters (a checkpoint's record), None without any."""
    adapters = [module for module in model.modules() if isinstance(module, LinearLoRA)]
    if not adapters:
        return None
    projections = sorted({proj for adapter in adapters for proj in adapter.lora_A})
    rank = next(iter(adapters[0].lora_A.values())).shape[0]
    return {"rank": rank, "scale": adapters[0].scale, "projections": projections}


def checkpointed_model_state(sharded_state: dict, model) -> dict:
    """The model tensors a checkpoint holds: only the adapters when ``model`` has some (the base is re-read)."""
    if adapter_signature(model) is None:
        return sharded_state
    return {key: value for key, value in sharded_state.items() if f"{SUFFIX}." in key}


def check_adapter_signature(saved: dict | None, model, folder: str) -> None:
    """Refuse a checkpoint whose adapters (``saved``, None: full fine-tuning) are not ``model``'s, before loading.

    Raises:
        ValueError: naming both and the ``model.lora`` setting to resume with.
    """
    current = adapter_signature(model)
    if saved == current:
        return

    def describe(signature):
        return "full fine-tuning (no adapters)" if signature is None else f"LoRA {signature}"

    fix = "model.lora.rank=null" if saved is None else (
        f"model.lora.rank={saved['rank']}, alpha={saved['scale'] * saved['rank']:g}, "
        f"target_modules={saved['projections']}"
    )  # fmt: skip
    raise ValueError(
        f"checkpoint {folder!r} was written with {describe(saved)}, this run has {describe(current)}; resume with {fix}"
    )
