"""The rollout engine contract shared by the trainer, the evaluator and weight sync.

``rollout.vllm_engine.VLLMEngine`` implements ``RolloutEngine``. Weight updates take Hugging Face names and full,
unsharded tensors, either at once (``update_weights``, one bucket: small updates and tests) or streamed in
byte-bounded buckets (``begin_weight_update`` / ``load_weight_bucket`` / ``finish_weight_update``, driven by
``rollout.push``). Parameters not named keep their values, but an update names every member of a fused module
(q/k/v, gate/up). After an update the next ``generate`` uses the new weights and no stale prefix-cache entry.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from gtpo_megatron.rollout.types import PromptCompletions

NamedTensor = tuple[str, "torch.Tensor"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SamplingConfig:
    """Sampling parameters of one ``generate`` call (docs/algorithm.md section 6 for the paper's values).

    A matched ``stop`` string stays in the text and the token ids. ``seed`` seeds sample ``j`` of the prompt with
    global index ``i`` from ``(seed, i, j)`` (:func:`request_seed`); None uses the engine's generator. ``logprobs``
    returns each sampled token's rollout log-prob in nats.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    max_tokens: int = 256
    stop: tuple[str, ...] = ()
    seed: int | None = None
    logprobs: bool = True

    def __post_init__(self) -> None:
        if not self.temperature > 0:
            raise ValueError(
                f"sampling.temperature={self.temperature} must be > 0 (greedy decoding is not supported by the "
                "rollout engine); use a small value such as 1e-3 for near-greedy sampling"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"sampling.top_p={self.top_p} must be in (0, 1]; use 1.0 to disable nucleus sampling")
        if self.max_tokens < 1:
            raise ValueError(f"sampling.max_tokens={self.max_tokens} must be >= 1")
        if isinstance(self.stop, str):
            raise ValueError(f"sampling.stop={self.stop!r} must be a sequence of strings, e.g. ({self.stop!r},)")


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """vLLM seed of one sample: a 63-bit BLAKE2b hash of ``(seed, prompt_index, sample_index)``."""
    digest = hashlib.blake2b(f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def check_prompt_indices(prompt_indices: Sequence[int] | None, num_prompts: int) -> list[int]:
    """The global index of each prompt: ``prompt_indices`` checked, or ``0 .. num_prompts - 1`` when ``None``.

    Raises:
        ValueError: wrong length, a negative index or a repeated one (two prompts would share random streams).
    """
    if prompt_indices is None:
        return list(range(num_prompts))
    indices = [int(i) for i in prompt_indices]
    if len(indices) != num_prompts or min(indices, default=0) < 0 or len(set(indices)) != num_prompts:
        raise ValueError(
            f"prompt_indices={indices} must hold {num_prompts} distinct indices >= 0 (one global index per prompt of "
            "the batch); pass None for 0..P-1"
        )
    return indices


def validate_prompt_ids(prompt_ids: Sequence[Sequence[int]], *, max_model_len: int, max_tokens: int) -> None:
    """Check a batch of tokenised prompts before it reaches an engine.

    Raises:
        ValueError: empty batch, an empty prompt, or a prompt with ``len + max_tokens > max_model_len`` (the
            message names the prompt index, its length and the fix).
    """
    if len(prompt_ids) == 0:
        raise ValueError("prompt_ids is empty; pass at least one tokenised prompt")
    for i, ids in enumerate(prompt_ids):
        if len(ids) == 0:
            raise ValueError(f"prompt_ids[{i}] is empty; every prompt needs at least one token")
        if len(ids) + max_tokens > max_model_len:
            raise ValueError(
                f"prompt_ids[{i}] has {len(ids)} tokens and max_tokens={max_tokens}, which exceeds "
                f"max_model_len={max_model_len}; raise max_model_len, lower max_tokens or shorten the prompt"
            )


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer and the evaluator need from a generation engine."""

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[PromptCompletions]:
        """P tokenised prompts -> P ``PromptCompletions`` of ``n`` completions each, in prompt order.

        ``prompt_indices``: each prompt's distinct global index, which seeds its samples (default ``0 .. P-1``).
        """
        ...

    def update_weights(self, named_tensors: Iterable[NamedTensor]) -> None:
        """Load ``(hf_name, full_tensor)`` pairs as one update (begin, one bucket, finish)."""
        ...

    def begin_weight_update(self) -> None:
        """Start a streamed weight update (buckets follow)."""
        ...

    def load_weight_bucket(self, bucket: Sequence[NamedTensor]) -> None:
        """Hand over one bucket of ``(hf_name, full_tensor)`` pairs of the update in progress."""
        ...

    def finish_weight_update(self) -> None:
        """Apply every bucket handed over since ``begin_weight_update`` and reset the prefix cache."""
        ...

    def sleep(self) -> None:
        """Release accelerator memory while the policy trains (no-op where unsupported)."""
        ...

    def wake_up(self) -> None:
        """Undo ``sleep`` before the next ``generate``."""
        ...

    def close(self) -> None:
        """Shut the engine down and free its processes; idempotent."""
        ...
