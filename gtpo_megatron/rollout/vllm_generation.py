"""``VLLMEngine``'s generation and scoring: completions with token ids, text, finish reasons, ``processed_logprobs``.

Every (prompt, sample) pair is its own ``n=1`` request seeded by :func:`request_seed` of the call's seed, the
prompt's global index and the sample (vLLM's ``n > 1`` would share streams between neighbouring prompts); with
``settings.max_lora_rank`` each carries the adapter ``load_adapter`` last installed (``vllm_lora``). Routed experts
(docs/moe.md): ``[P + R - 1, L, K]`` int16 per completion; on CPU one more seeded prefill of it (prefix caching off)
is read from the workers' capturer (``vllm_start``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from gtpo_megatron.rollout.engine import SamplingConfig, check_prompt_indices, request_seed, validate_prompt_ids
from gtpo_megatron.rollout.types import Completion, PromptCompletions, span_versions
from gtpo_megatron.rollout.vllm_lora import AdapterSlot

_FINISH_REASONS = ("stop", "length")


class VLLMGeneration:
    """``generate`` and ``score`` of ``VLLMEngine``, which sets these attributes when it starts."""

    _llm: Any  # the vllm.LLM (or vllm_async_engine.AsyncFacade)
    _adapter: AdapterSlot  # the served LoRA adapter
    max_model_len: int
    _capture_by_prefill: bool  # routed experts read by a second prefill (CPU)

    def generate(
        self,
        prompt_ids: Sequence[Sequence[int]],
        n: int,
        sampling: SamplingConfig,
        prompt_indices: Sequence[int] | None = None,
    ) -> list[PromptCompletions]:
        """Sample ``n`` completions for each of P prompts (``RolloutEngine.generate``; seeds: module docstring).

        ``rollout_logprobs`` in nats (empty without ``sampling.logprobs``); ``text`` decodes ``token_ids`` (past a
        stop string too); ``prompt_indices``: distinct global indices, default ``0 .. P-1``.

        Raises:
            ValueError: ``n < 1``, an empty or too long prompt, or bad ``prompt_indices``.
            RuntimeError: vLLM aborted a request (finish reason other than stop/length).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if n < 1:
            raise ValueError(f"n={n} must be >= 1 (completions per prompt)")
        validate_prompt_ids(prompt_ids, max_model_len=self.max_model_len, max_tokens=sampling.max_tokens)
        indices = check_prompt_indices(prompt_indices, len(prompt_ids))
        params = [
            SamplingParams(
                n=1,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                max_tokens=sampling.max_tokens,
                stop=list(sampling.stop) or None,
                include_stop_str_in_output=True,
                seed=None if sampling.seed is None else request_seed(sampling.seed, index, sample),
                logprobs=0 if sampling.logprobs else None,
            )
            for index in indices
            for sample in range(n)
        ]
        prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in ids]) for ids in prompt_ids for _ in range(n)]
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter.request)
        decode = self._llm.get_tokenizer().decode
        groups = [
            PromptCompletions(
                prompt_ids=list(ids),
                completions=[to_completion(o.outputs[0], decode) for o in outputs[i * n : (i + 1) * n]],
            )
            for i, ids in enumerate(prompt_ids)
        ]
        if self._capture_by_prefill:
            for group in groups:
                for completion in group.completions:
                    completion.routed_experts = self._prefill_routed_experts(group.prompt_ids, completion.token_ids)
        return groups

    def _prefill_routed_experts(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> torch.Tensor:
        """``[P + R - 1, L, K]`` int16: one prefill of the fed tokens, read from the workers' capturer (CPU)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        fed = [int(t) for t in prompt_ids] + [int(t) for t in token_ids[:-1]]
        params = SamplingParams(max_tokens=1, detokenize=False, seed=0)
        self._llm.generate([TokensPrompt(prompt_token_ids=fed)], params, use_tqdm=False,
                           lora_request=self._adapter.request)  # fmt: skip
        shape, data = self._llm.collective_rpc("gtpo_captured_experts", args=(len(fed),))[0]
        return torch.frombuffer(bytearray(data), dtype=torch.int16).reshape(shape)

    def score(self, prompt_ids: Sequence[Sequence[int]], completion_ids: Sequence[Sequence[int]]) -> list[list[float]]:
        """Log-probabilities (nats, temperature 1) of P non-empty completions given their prompts: P lists of floats.

        Raises:
            ValueError: mismatched lengths, an empty completion, or a sequence longer than ``max_model_len``.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if len(prompt_ids) != len(completion_ids) or any(len(c) == 0 for c in completion_ids):
            raise ValueError(
                f"score needs one non-empty completion per prompt; got {len(prompt_ids)} prompts and completion "
                f"lengths {[len(c) for c in completion_ids]}"
            )
        full = [[int(t) for t in p] + [int(t) for t in c] for p, c in zip(prompt_ids, completion_ids, strict=True)]
        validate_prompt_ids(full, max_model_len=self.max_model_len, max_tokens=1)
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
        prompts = [TokensPrompt(prompt_token_ids=f) for f in full]
        outputs = self._llm.generate(prompts, params, use_tqdm=False, lora_request=self._adapter.request)
        scores = []
        for p, f, out in zip(prompt_ids, full, outputs, strict=True):
            scores.append([out.prompt_logprobs[pos][f[pos]].logprob for pos in range(len(p), len(f))])
        return scores


def to_completion(output, decode: Callable[..., str]) -> Completion:
    """Convert one ``vllm.CompletionOutput`` (typed loosely: vLLM types stay out of signatures).

    A stop string's completion gets ``decode(token_ids)`` as its text (``generate``); ``decode`` is the tokenizer's.
    """
    if output.finish_reason not in _FINISH_REASONS:
        raise RuntimeError(f"vLLM finished a request with reason {output.finish_reason!r} (aborted or failed)")
    token_ids = [int(t) for t in output.token_ids]
    logprobs = [] if output.logprobs is None else [d[t].logprob for d, t in zip(output.logprobs, token_ids)]
    text = decode(token_ids, skip_special_tokens=True) if isinstance(output.stop_reason, str) else output.text
    routed = getattr(output, "routed_experts", None)  # [P + R - 1, L, K] numpy with enable_return_routed_experts
    return Completion(
        token_ids=token_ids, rollout_logprobs=logprobs, text=text, finish_reason=output.finish_reason,
        routed_experts=None if routed is None else torch.as_tensor(routed).to(torch.int16),
        token_versions=span_versions(getattr(output, "weight_versions", None), len(token_ids)),
    )  # fmt: skip
