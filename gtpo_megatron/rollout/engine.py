"""The rollout engine contract shared by the trainer, the evaluator and weight sync.

``RolloutEngine`` is a ``typing.Protocol``: ``rollout.vllm_engine.VLLMEngine`` is the real implementation (the only
module that imports vLLM). ``SamplingConfig`` carries the per-call sampling parameters
(``docs/algorithm.md`` section 6: temperature 0.9, top_p 1, at most 1500 new tokens in the paper).

Weight updates come in two granularities:
- ``update_weights(named_tensors)``: one complete update from any iterable of ``(hf_name, tensor)`` pairs
  (materialised as one bucket; meant for small updates and tests).
- ``begin_weight_update()`` / ``load_weight_bucket(bucket)`` / ``finish_weight_update()``: the streaming form that
  ``rollout.push.push_weights`` drives with byte-bounded buckets, so a whole model never sits in memory twice.
Both take Hugging Face (vLLM checkpoint) names and full, unsharded tensors; parameters not named keep their values,
except that an update must name all members of a module the engine fuses (q/k/v projections, gate/up projections).
After an update returns, the next ``generate`` uses the new weights and no prefix-cache entry computed with the old
weights is reused.
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
    """Sampling parameters of one ``generate`` call.

    Attributes:
        temperature: softmax temperature (> 0; the trainer recomputes log-probs at the same temperature).
        top_p: nucleus mass in (0, 1]; 1 disables nucleus sampling.
        max_tokens: maximum number of new tokens per completion (>= 1).
        stop: stop strings; the matched string is kept in the text and in the token ids.
        seed: base seed of this call (sample ``j`` of the prompt with global index ``i`` gets a seed derived from
            ``(seed, i, j)``), or None for the engine's global generator. The same seed, prompts and weights give
            the same completions; pass a different seed each training step to get fresh samples.
        logprobs: return the rollout log-probability (nats) of every sampled token.
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
    """vLLM seed of sample ``sample_index`` of the prompt at global index ``prompt_index`` in a call seeded ``seed``.

    A 63-bit BLAKE2b hash of the triple, in ``[0, 2**63)``: the same triple always gets the same stream, and two
    different triples share one with probability ``2**-63`` (about 1e-7 for a run of a million samples).
    """
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
        """Sample ``n`` completions of every prompt.

        Args:
            prompt_ids: P tokenised (chat-templated) prompts.
            n: completions per prompt (the group size G, >= 1).
            sampling: sampling parameters of this call.
            prompt_indices: global index of each prompt in its batch (distinct), which seeds its samples together
                with ``sampling.seed``; default ``0 .. P-1``.

        Returns:
            P ``PromptCompletions`` in prompt order, each with ``n`` completions (token ids, text, finish reason
            ``"stop"``/``"length"``, and per-token rollout log-probs in nats when ``sampling.logprobs``).
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
