"""Build a Megatron-Core ``GPTModel`` (one pipeline stage, TP-sharded) from a Hugging Face decoder config.

Llama, Mistral, Qwen2 and Qwen3 map onto Megatron's GPT block (RMSNorm, SwiGLU, GQA, RoPE, optional tied
embeddings, biases, sliding windows), Qwen3-MoE, Qwen2-MoE and Mixtral onto the same block with an ``MoELayer``;
``hf_features`` and ``moe.features`` say how each HF setting is reproduced or why it is refused.
Dropout is 0. Transformer Engine layer specs when TE imports, Megatron's local specs otherwise (with SDPA as the
core attention, ``sdpa_attention``, and ``SequenceParallelRMSNorm`` under sequence parallelism). The embedding and
output layer have ``padded_vocab_size`` rows (``plan.layout``), the padded rows zero. Opt-in extras: zero KV groups
when they do not divide ``tp_size`` (``head_padding``) and fp32 logits from 16-bit parameters (``output_layer``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F

from gtpo_megatron.megatron_adapter.head_padding import padded_num_query_groups
from gtpo_megatron.megatron_adapter.hf_conversion import expert_index
from gtpo_megatron.megatron_adapter.hf_features import (
    LinearBiases,
    check_hf_config,
    has_qk_norm,
    linear_biases,
    rope_settings,
    sliding_window_settings,
)
from gtpo_megatron.megatron_adapter.moe.compat import install_moe_compat
from gtpo_megatron.megatron_adapter.moe.features import moe_transformer_fields
from gtpo_megatron.megatron_adapter.output_layer import use_fp32_output_layer
from gtpo_megatron.plan.architectures import architecture_from_hf_config
from gtpo_megatron.plan.layout import expert_problems, raise_problems

if TYPE_CHECKING:
    from gtpo_megatron.config.model import ModelConfig
    from gtpo_megatron.megatron_adapter.settings import PolicySettings

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def transformer_engine_available() -> bool:
    """True when ``transformer_engine`` imports cleanly (a broken TE install counts as absent)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a meta package without CUDA raises RuntimeError (and breaks megatron)
        return False
    return True


LayerBackend = Literal["transformer_engine", "local"]


def layer_spec_backend(model: ModelConfig | None = None) -> LayerBackend:
    """The layer spec ``model.layer_spec`` resolves to (docstring of that field); None: ``auto`` without LoRA.

    Raises:
        ValueError: ``transformer_engine`` asked for where it does not import, naming the field and the fix.
    """
    asked = "auto" if model is None else model.layer_spec
    if asked == "auto":
        lora = model is not None and model.lora.enabled
        return "transformer_engine" if transformer_engine_available() and not lora else "local"
    if asked == "transformer_engine" and not transformer_engine_available():
        raise ValueError(
            "model.layer_spec=transformer_engine: transformer_engine does not import here; install it (bash "
            "launch/install.sh gpu) or set model.layer_spec=auto"
        )
    return asked


@functools.cache
def _with_bias(linear_cls: type) -> type:
    """``linear_cls`` built with a bias whatever ``add_bias_linear`` says (HF o_proj / MLP biases)."""

    def __init__(self, *args, bias, **kwargs):
        linear_cls.__init__(self, *args, bias=True, **kwargs)

    doc = f"{linear_cls.__name__} that always has a bias (HF per-module biases)."
    return type(f"Biased{linear_cls.__name__}", (linear_cls,), {"__init__": __init__, "__doc__": doc})


def _add_biases(spec, biases: LinearBiases):
    """A copy of the GPT layer ``spec`` whose o_proj (``linear_proj``) and MLP linears have the HF biases."""
    layer = spec.submodules
    attention, mlp = layer.self_attention, layer.mlp
    if biases.proj:
        linear_proj = _with_bias(attention.submodules.linear_proj)
        attention = dataclasses.replace(
            attention, submodules=dataclasses.replace(attention.submodules, linear_proj=linear_proj)
        )
    if biases.mlp:
        submodules = mlp_submodules(mlp)
        mlp = _with_mlp_submodules(
            mlp,
            dataclasses.replace(
                submodules,
                linear_fc1=_with_bias(submodules.linear_fc1),
                linear_fc2=_with_bias(submodules.linear_fc2),
            ),
        )
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention, mlp=mlp))


def mlp_submodules(mlp):
    """The ``MLPSubmodules`` of a spec's ``mlp`` entry (a ``ModuleSpec`` in 0.16, a ``partial`` in 0.17+)."""
    return mlp.keywords["submodules"] if isinstance(mlp, functools.partial) else mlp.submodules


def _with_mlp_submodules(mlp, submodules):
    """A copy of the ``mlp`` spec entry (either form of :func:`mlp_submodules`) with other submodules."""
    if isinstance(mlp, functools.partial):
        return functools.partial(mlp.func, *mlp.args, **{**mlp.keywords, "submodules": submodules})
    return dataclasses.replace(mlp, submodules=submodules)


class SequenceParallelRMSNorm:
    """``torch.nn.RMSNorm`` usable under sequence parallelism (Megatron's ``WrappedTorchNorm`` refuses it).

    Each TP rank normalises its slice of the sequence, so the weight's gradient is a partial sum: the weight carries
    the ``sequence_parallel`` tag, and ``finalize_model_grads`` sums tagged gradients over the TP group. Same
    parameters and state-dict names as Megatron's norm.
    """

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **unused):  # noqa: D102 (see the class)
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        norm.weight.sequence_parallel = config.sequence_parallel
        return norm


def _with_sdpa_attention(spec):
    """A copy of the local GPT layer ``spec`` whose core attention is ``sdpa_attention.SDPAttention``."""
    from gtpo_megatron.megatron_adapter.sdpa_attention import sdpa_attention_class

    layer = spec.submodules
    attention = dataclasses.replace(
        layer.self_attention,
        submodules=dataclasses.replace(layer.self_attention.submodules, core_attention=sdpa_attention_class()),
    )
    return dataclasses.replace(spec, submodules=dataclasses.replace(layer, self_attention=attention))


def _with_sequence_parallel_norms(spec):
    """A copy of the local GPT layer ``spec`` whose norms are :class:`SequenceParallelRMSNorm`."""
    from megatron.core.transformer.identity_op import IdentityOp

    layer = spec.submodules
    attention = layer.self_attention.submodules
    qk = {
        name: SequenceParallelRMSNorm
        for name in ("q_layernorm", "k_layernorm")
        if getattr(attention, name) is not IdentityOp
    }
    attention_spec = dataclasses.replace(layer.self_attention, submodules=dataclasses.replace(attention, **qk))
    layer = dataclasses.replace(
        layer,
        input_layernorm=SequenceParallelRMSNorm,
        pre_mlp_layernorm=SequenceParallelRMSNorm,
        self_attention=attention_spec,
    )
    return dataclasses.replace(spec, submodules=layer)


def select_layer_spec(
    *,
    qk_layernorm: bool,
    biases: LinearBiases,
    sequence_parallel: bool = False,
    num_experts: int | None = None,
    backend: LayerBackend | None = None,
):
    """``(layer_spec, backend)``, logged once; ``backend`` None: :func:`layer_spec_backend`'s default.

    ``biases`` and ``sequence_parallel`` adapt the local spec (TE's supports both natively); ``num_experts`` makes
    the MLP an ``MoELayer`` (TE: grouped GEMMs, local: ``SequentialMLP``).
    """
    from megatron.core.models.gpt import gpt_layer_specs

    backend = backend or layer_spec_backend()
    if backend == "transformer_engine":
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_layernorm
        )
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(
            num_experts=num_experts, qk_layernorm=qk_layernorm, normalization="RMSNorm"
        )
        spec = _with_sdpa_attention(spec)
        if sequence_parallel:
            spec = _with_sequence_parallel_norms(spec)
    logger.info("Megatron GPT layer spec: %s", backend)
    return _add_biases(spec, biases), backend


def _block_spec(layer_spec, backend: str, config):
    """The layer spec, or with sequence parallelism on the local spec the block's submodules."""
    if backend != "local" or not config.sequence_parallel:
        return layer_spec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    num_layers = get_num_layers_to_build(config)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelRMSNorm)


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def transformer_config_from_hf(hf_config, settings: PolicySettings, *, padding_tp_size: int | None = None):
    """The ``TransformerConfig`` for ``hf_config``: engine defaults < HF fields < settings < ``megatron_overrides``.

    Raises:
        ValueError: an HF feature that cannot be built (``hf_features``), heads or KV groups not divisible by
            ``tp_size`` (without ``model.pad_attention_heads``), layers not divisible by ``pp_size``, an expert
            layout Megatron cannot form (``plan.layout.expert_problems``), packing with sliding windows.
    """
    from megatron.core.transformer import TransformerConfig

    fields = {
        **_engine_fields(),
        **hf_transformer_fields(hf_config, settings, padding_tp_size=padding_tp_size),
        **settings_transformer_fields(settings),
    }
    _check_packing(fields, settings)
    return TransformerConfig(**{**fields, **settings.model.megatron_overrides})


def check_hf_model(hf_config, settings: PolicySettings) -> None:
    """Every refusal of :func:`transformer_config_from_hf` that needs no process group, before anything is built.

    Raises:
        ValueError: as :func:`hf_transformer_fields`, or packing with a sliding window.
    """
    _check_packing(hf_transformer_fields(hf_config, settings), settings)


def _check_packing(fields: dict, settings: PolicySettings) -> None:
    """Refuse packing where the packed row's attention would cross sequences (sliding windows replace its mask)."""
    if settings.token_budget is None or not settings.token_budget.packing or "window_size" not in fields:
        return
    raise ValueError(
        f"optim.packing=true with a sliding-window model (window_size={fields['window_size']}): the windowed "
        "attention builds its own mask, which would let packed sequences attend to each other; set "
        "optim.packing=false (token-budget micro-batches are padded then)"
    )


def _engine_fields() -> dict:
    """This package's choices for the fields no config sets (RL fine-tuning: no dropout; portable kernels)."""
    return dict(
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        attention_softmax_in_fp32=True,
    )


def hf_transformer_fields(hf_config, settings: PolicySettings, *, padding_tp_size: int | None = None) -> dict:
    """The architecture fields read from the HF config; with ``pad_attention_heads``, the padded KV-group count.

    Raises:
        ValueError: as :func:`transformer_config_from_hf`.
    """
    check_hf_config(hf_config)
    num_heads = hf_config.num_attention_heads
    num_groups = getattr(hf_config, "num_key_value_heads", None) or num_heads
    padded_groups = padded_num_query_groups(
        num_heads=num_heads,
        num_query_groups=num_groups,
        tp_size=settings.tp_size,
        pad_attention_heads=settings.model.pad_attention_heads,
        padding_tp_size=padding_tp_size,
    )
    if hf_config.num_hidden_layers % settings.pp_size:
        raise ValueError(
            f"num_hidden_layers={hf_config.num_hidden_layers} is not divisible by pp_size={settings.pp_size}"
        )
    arch = architecture_from_hf_config(hf_config.to_dict(), name=f"model_type={hf_config.model_type!r}")
    raise_problems(
        expert_problems(
            arch, ep_size=settings.ep_size, tp_size=settings.tp_size, sequence_parallel=settings.sequence_parallel
        )
    )
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    return dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_attention_heads=padded_groups * (num_heads // num_groups),
        num_query_groups=padded_groups,
        kv_channels=head_dim,  # explicit: with head padding heads * head_dim != hidden_size
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,  # o_proj and MLP biases: per-module linear classes (select_layer_spec)
        add_qkv_bias=linear_biases(hf_config).qkv,
        qk_layernorm=has_qk_norm(hf_config),
        **sliding_window_settings(hf_config),
        **moe_transformer_fields(
            hf_config, settings, grouped_gemm=layer_spec_backend(settings.model) == "transformer_engine"
        ),
    )


def settings_transformer_fields(settings: PolicySettings) -> dict:
    """The fields the config sections set: layout, sequence parallelism, precision, recompute and the loss contracts."""
    dtype = _DTYPES[settings.model.params_dtype]
    full = settings.model.recompute == "full"
    return dict(
        tensor_model_parallel_size=settings.tp_size,
        pipeline_model_parallel_size=settings.pp_size,
        sequence_parallel=settings.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=False,
        recompute_granularity=None if settings.model.recompute == "none" else settings.model.recompute,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        **_variable_shapes(settings),
        calculate_per_token_loss=False,
        # Weights are overwritten from the HF checkpoint, but Megatron only tags TP-sharded weights
        # (``tensor_model_parallel``, read by grad-norm/clipping) inside its init path: keep it on.
        perform_initialization=True,
    )


def _variable_shapes(settings: PolicySettings) -> dict:
    """With PP > 1, token-budget micro-batches make the stages exchange each micro-batch's shape first.

    Megatron refuses that with its default ``allgather`` MoE dispatcher, so ``alltoall`` is named (unused if dense).
    """
    variable = settings.token_budget is not None and settings.pp_size > 1
    return {"variable_seq_lengths": True, "moe_token_dispatcher_type": "alltoall"} if variable else {}


def build_gpt_model(
    hf_config,
    config,
    *,
    padded_vocab_size: int,
    pre_process: bool,
    post_process: bool,
    fp32_output_layer: bool = False,
    backend: LayerBackend | None = None,
):
    """This rank's ``GPTModel`` stage, ``parallel_output=True``, random weights in ``config.params_dtype``.

    Logits are ``[B, S, V/tp]``, fp32 with ``fp32_output_layer`` (16-bit parameters only). ``backend``: the layer
    spec (:func:`layer_spec_backend`; None: its default), set as the model's ``layer_spec_backend``. Collectives:
    with tied embeddings and PP > 1, one all-reduce on Megatron's embedding group (inside ``GPTModel``; under
    ``cpu_compat.cuda_to_cpu_mode()`` on CPU).

    Raises:
        ValueError: ``fp32_output_layer`` with ``config.gradient_accumulation_fusion``.
    """
    from megatron.core.models.gpt import GPTModel

    if config.num_moe_experts:
        install_moe_compat()
    spec, backend = select_layer_spec(
        qk_layernorm=config.qk_layernorm,
        biases=linear_biases(hf_config),
        sequence_parallel=config.sequence_parallel,
        num_experts=config.num_moe_experts,
        backend=backend,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=_block_spec(spec, backend, config),
        vocab_size=padded_vocab_size,
        max_sequence_length=getattr(hf_config, "max_position_embeddings", 4096),
        pre_process=pre_process,
        post_process=post_process,
        parallel_output=True,
        share_embeddings_and_output_weights=bool(getattr(hf_config, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        **rope_settings(hf_config),
    )
    model.layer_spec_backend = backend
    if config.num_moe_experts:
        _tag_experts_expert_parallel(model)
    if fp32_output_layer and post_process and config.params_dtype != torch.float32:
        use_fp32_output_layer(model.output_layer)
    _to_params_dtype(model, config.params_dtype)
    if torch.cuda.is_available():
        # Megatron's parallel layers allocate on the current device, but plain torch modules of the local spec
        # (its RMSNorms) are built on the CPU; Megatron-LM's get_model moves the whole stage the same way.
        model.cuda(torch.cuda.current_device())
    return model


def _tag_experts_expert_parallel(model) -> None:
    """Tag every expert parameter expert-parallel (``allreduce=False``), as Megatron does only at EP > 1.

    Megatron then reduces its gradient over the expert-data-parallel group, which at EP = 1 is the data-parallel
    group (the same sum), and gives experts their own optimizer: the optimizer state has one structure at every EP
    size, so a checkpoint written at EP = 1 loads at EP > 1 and the reverse.
    """
    for name, param in model.named_parameters():
        if expert_index(name) >= 0:
            param.allreduce = False


def _to_params_dtype(model, params_dtype: torch.dtype) -> None:
    """Cast every floating-point parameter to ``params_dtype`` in place, keeping each object and its Megatron tags.

    The local spec's torch norms are built in fp32, and Megatron's 16-bit optimizer cannot checkpoint fp32
    parameters (Megatron-LM casts the stage with ``Float16Module`` for the same reason).
    """
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != params_dtype:
            param.data = param.data.to(params_dtype)


def causal_attention_mask(seq_len: int, backend: str, segment_ids: torch.Tensor | None = None) -> torch.Tensor | None:
    """A packed row's ``[1, 1, S, S]`` bool mask (True = masked) for the local spec, else None.

    None is the causal mask of both specs (Transformer Engine's by its spec, the local spec's ``SDPAttention`` as
    SDPA's ``is_causal``, Megatron's own attention builds it when it runs). ``segment_ids`` ``[S]`` (a packed row,
    ``ops.PackedLayout.segment_ids``): block-diagonal, a column sees only the earlier columns of its own segment.
    """
    if backend == "transformer_engine" or segment_ids is None:
        return None
    masked = torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)
    masked |= segment_ids[:, None] != segment_ids[None, :]
    return masked[None, None]
