"""The ``model.lora`` section: low-rank adapters on the decoder's linears instead of full fine-tuning.

The adapters follow Hugging Face peft's parametrisation, one adapter per HF projection (``delta W = alpha / rank *
B @ A``, ``A`` ``[rank, in]``, ``B`` ``[out, rank]`` initialised to zero), so a q_proj adapter is the same tensor
pair in peft, in this trainer and in an exported adapter folder. How they sit on Megatron's fused linears and their
tensor-parallel shards: ``megatron_adapter/lora.py`` and docs/algorithm.md section 6.
"""

from __future__ import annotations

from dataclasses import dataclass

from gtpo_megatron.config.checks import require as _require

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
LORA_PROJECTIONS = ATTENTION_PROJECTIONS + MLP_PROJECTIONS
"""The HF projection names ``model.lora.target_modules`` may list (``all-linear``: all seven)."""
ALL_LINEAR = "all-linear"


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters (``model.lora.*``); ``rank`` null is full fine-tuning."""

    rank: int | None = None
    """Adapter rank r (the paper: 128); null: no adapters, every weight trains."""
    alpha: float | None = None
    """Scale numerator: the adapter adds ``alpha / rank * B @ A`` (null: ``rank``, a scale of 1; the paper: 128)."""
    dropout: float = 0.0
    """Dropout on the adapters' input while training (peft's ``lora_dropout``); only 0 at ``parallel.tp_size > 1``."""
    target_modules: tuple[str, ...] = (ALL_LINEAR,)
    """HF projections that get an adapter: any of q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj,
    or ``all-linear`` (all seven; the paper's setting). The embedding and output layer never do."""

    def __post_init__(self) -> None:
        _require(
            self.rank is None or self.rank >= 1, "model.lora.rank", self.rank, "must be >= 1 or null",
            "use 128 (paper) or a smaller power of two such as 16, or null for full fine-tuning",
        )  # fmt: skip
        _require(
            self.alpha is None or self.alpha > 0, "model.lora.alpha", self.alpha, "must be > 0 or null",
            "use the rank (scale 1; the paper's 128 with rank 128) or null",
        )  # fmt: skip
        _require(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "must be in [0, 1)", "use 0")
        known = (*LORA_PROJECTIONS, ALL_LINEAR)
        unknown = [name for name in self.target_modules if name not in known]
        _require(
            not unknown and bool(self.target_modules), "model.lora.target_modules", self.target_modules,
            f"names {unknown or 'nothing'}; each must be one of {list(known)}",
            "list HF projections, e.g. [q_proj, k_proj, v_proj, o_proj], or use [all-linear]",
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        """True when adapters are trained (``rank`` is set)."""
        return self.rank is not None

    @property
    def scale(self) -> float:
        """``alpha / rank`` (1.0 with ``alpha`` null); only meaningful when :attr:`enabled`."""
        rank = self.rank or 1
        return (self.alpha if self.alpha is not None else rank) / rank

    @property
    def projections(self) -> tuple[str, ...]:
        """The targeted HF projections in ``LORA_PROJECTIONS`` order (``all-linear`` expanded)."""
        if ALL_LINEAR in self.target_modules:
            return LORA_PROJECTIONS
        return tuple(name for name in LORA_PROJECTIONS if name in self.target_modules)
