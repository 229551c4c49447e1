"""Model dimensions the planner needs, read from a local HF ``config.json`` or a table of public models.

The table copies the published ``config.json`` of ``Qwen/<name>`` and ``meta-llama/<name>``; biases and q/k norms
come from each model's family (``plan.model_families``). A mixture-of-experts model (Qwen3-MoE, Qwen2-MoE, Mixtral)
replaces each layer's MLP with a router ``[E, h]``, ``E`` SwiGLU experts of width ``f_e`` of which ``k`` see each
token, and optionally a shared expert of width ``f_s`` with a ``[1, h]`` gate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from gtpo_megatron.plan.model_families import FAMILIES, moe_sizes, planning_family


@dataclass(frozen=True, kw_only=True, slots=True)
class Architecture:
    """Dimensions of a dense decoder-only transformer (RMSNorm, SwiGLU, GQA, RoPE).

    ``L`` layers, width ``h``, SwiGLU width ``f``, ``a`` query heads, ``g`` KV heads, ``d`` = ``head_dim``
    (``a * d`` need not equal ``h``), ``vocab_size`` before Megatron's padding.
    """

    name: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    vocab_size: int
    tied_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    num_experts: int = 0
    """Experts of each MoE layer ``E`` (0: a dense model; ``ffn_hidden_size`` is then the MLP's width)."""
    expert_ffn_size: int = 0
    """Width ``f_e`` of one expert."""
    top_k: int = 0
    """Experts ``k`` each token is routed to."""
    shared_expert_ffn_size: int = 0
    """Width ``f_s`` of the shared expert (0: none)."""

    @property
    def q_width(self) -> int:
        """Width of the query projection output, ``a * d``."""
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        """Width of the key (or value) projection output, ``g * d``."""
        return self.num_query_groups * self.head_dim

    def layer_params(self) -> int:
        """Parameters of one transformer layer: attention, the MLP (every expert), two RMSNorms (+ bias, qk-norm)."""
        return self.attention_params() + self.mlp_params(self.num_experts) + 2 * self.hidden_size

    def attention_params(self) -> int:
        """Attention parameters of one layer: q/k/v/o projections, the q/k/v bias and the q/k norms."""
        h = self.hidden_size
        attention = h * (self.q_width + 2 * self.kv_width) + self.q_width * h
        bias = self.q_width + 2 * self.kv_width if self.qkv_bias else 0
        return attention + bias + (2 * self.head_dim if self.qk_norm else 0)

    def expert_params(self) -> int:
        """Parameters of one expert, ``3 h f_e`` (0 for a dense model)."""
        return 3 * self.hidden_size * self.expert_ffn_size

    def mlp_params(self, experts: int) -> int:
        """MLP parameters of one layer counting ``experts`` experts (a dense model: its SwiGLU).

        An MoE layer: the router, ``experts`` experts and the shared expert with its gate.
        """
        h = self.hidden_size
        if not self.num_experts:
            return 3 * h * self.ffn_hidden_size
        shared = 3 * h * self.shared_expert_ffn_size + h if self.shared_expert_ffn_size else 0
        return self.num_experts * h + experts * self.expert_params() + shared

    def active_params(self) -> int:
        """Parameters one token passes through (``k`` experts a layer; all of them for a dense model): FLOPs."""
        layer = self.attention_params() + self.mlp_params(self.top_k) + 2 * self.hidden_size
        embeddings = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return self.num_layers * layer + self.hidden_size + embeddings

    def embedding_params(self, padded_vocab_size: int | None = None) -> int:
        """Parameters of one embedding matrix (``padded_vocab_size`` rows when given, else ``vocab_size``)."""
        return (padded_vocab_size or self.vocab_size) * self.hidden_size

    def total_params(self, padded_vocab_size: int | None = None) -> int:
        """All parameters: layers, final norm, input embedding and (when untied) the output layer."""
        embeddings = self.embedding_params(padded_vocab_size) * (1 if self.tied_embeddings else 2)
        return self.num_layers * self.layer_params() + self.hidden_size + embeddings


def _entry(name, model_type, layers, hidden, ffn, heads, groups, vocab, tied, *, head_dim=None, **moe):
    family = FAMILIES[model_type]
    return Architecture(
        name=name, num_layers=layers, hidden_size=hidden, ffn_hidden_size=ffn, num_attention_heads=heads,
        num_query_groups=groups, head_dim=head_dim or hidden // heads, vocab_size=vocab, tied_embeddings=tied,
        qkv_bias=family.qkv_bias.read({}), qk_norm=family.qk_norm, **moe,
    )  # fmt: skip


# Values from each model's published config.json (see the module docstring).
KNOWN_ARCHITECTURES: dict[str, Architecture] = {
    a.name: a
    for a in (
        _entry("Qwen2.5-1.5B-Instruct", "qwen2", 28, 1536, 8960, 12, 2, 151936, True),
        _entry("Qwen2.5-3B-Instruct", "qwen2", 36, 2048, 11008, 16, 2, 151936, True),
        _entry("Qwen2.5-7B-Instruct", "qwen2", 28, 3584, 18944, 28, 4, 152064, False),
        _entry("Qwen2.5-32B-Instruct", "qwen2", 64, 5120, 27648, 40, 8, 152064, False),
        _entry("Qwen3-32B", "qwen3", 64, 5120, 25600, 64, 8, 151936, False, head_dim=128),
        _entry("Llama-3.1-8B-Instruct", "llama", 32, 4096, 14336, 32, 8, 128256, False),
        _entry("Llama-3.1-70B-Instruct", "llama", 80, 8192, 28672, 64, 8, 128256, False),
        _entry(
            "Qwen3-30B-A3B",
            "qwen3_moe",
            48,
            2048,
            6144,
            32,
            4,
            151936,
            False,
            head_dim=128,
            num_experts=128,
            expert_ffn_size=768,
            top_k=8,
        ),
        _entry(
            "Qwen3-235B-A22B",
            "qwen3_moe",
            94,
            4096,
            12288,
            64,
            4,
            151936,
            False,
            head_dim=128,
            num_experts=128,
            expert_ffn_size=1536,
            top_k=8,
        ),
    )
}


def architecture_from_hf_config(config: dict, name: str) -> Architecture:
    """Build an :class:`Architecture` from a parsed HF ``config.json`` (biases and q/k norms: its family).

    Raises:
        ValueError: a required key is missing (the message names it and the file's ``model_type``).
    """
    required = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "vocab_size")
    missing = [k for k in required if k not in config]
    if missing:
        raise ValueError(
            f"config.json of {name!r} (model_type={config.get('model_type')!r}) lacks {missing}; the planner "
            "supports dense llama/qwen2/qwen3 configs"
        )
    heads = config["num_attention_heads"]
    family = planning_family(config.get("model_type", ""))
    return Architecture(
        name=name,
        num_layers=config["num_hidden_layers"],
        hidden_size=config["hidden_size"],
        ffn_hidden_size=config["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        vocab_size=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        qkv_bias=family.qkv_bias.read(config),
        qk_norm=family.qk_norm,
        **moe_sizes(config),
    )


def resolve_architecture(name_or_path: str) -> Architecture:
    """Dimensions of ``name_or_path``: a local HF folder, a ``builtin:`` model, or a known hub name.

    Else the last path component (``Qwen/Qwen3-32B`` -> ``Qwen3-32B``) is looked up in :data:`KNOWN_ARCHITECTURES`.

    Raises:
        ValueError: neither a folder with ``config.json`` nor a known name (the message lists the known names).
    """
    from gtpo_megatron.builtin_models import resolve_model_path

    path = Path(resolve_model_path(name_or_path))
    if (path / "config.json").is_file():
        return architecture_from_hf_config(json.loads((path / "config.json").read_text()), name=path.name)
    key = name_or_path.rstrip("/").rsplit("/", 1)[-1]
    if key in KNOWN_ARCHITECTURES:
        return KNOWN_ARCHITECTURES[key]
    raise ValueError(
        f"model.name_or_path={name_or_path!r} is neither a local folder with config.json nor a known "
        f"architecture; download its config.json to a folder, or use one of {sorted(KNOWN_ARCHITECTURES)}"
    )
