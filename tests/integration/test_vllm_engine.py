"""The real vLLM engine on CPU (in-process): generation, rollout log-probs, seeding, scoring and weight updates.

The independent reference is Hugging Face transformers' forward pass on the same folder, in fp32:
``log_softmax(logits / T)`` gathered at the sampled tokens. One engine per test class (never two at a time).
SmolLM2-135M-Instruct's engine test lives in ``tests/evaluation/test_eval_smollm2.py``, which shares one engine
between it and the evaluator run.
"""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from gtpo_megatron.builtin_models import resolve_model_path
from gtpo_megatron.rollout.engine import SamplingConfig
from gtpo_megatron.rollout.engine_settings import EngineSettings
from gtpo_megatron.rollout.push import push_weights
from gtpo_megatron.rollout.vllm_engine import VLLMEngine

pytestmark = pytest.mark.integration

# fp32 on both sides; vLLM's CPU kernels (oneDNN GEMM, its own attention) sum in a different order than torch's.
TINY_ATOL = 1e-4


def hf_logprobs(model, prompt: list[int], completion: list[int], temperature: float = 1.0) -> torch.Tensor:
    """``[T]`` float64 log-probs of ``completion`` given ``prompt`` (reference, plain transformers)."""
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].double()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None])[:, 0]


def max_abs_diff(model, prompts, outputs, temperature: float) -> float:
    diffs = [
        (hf_logprobs(model, p, c.token_ids, temperature) - torch.tensor(c.rollout_logprobs).double()).abs().max()
        for p, out in zip(prompts, outputs)
        for c in out.completions
    ]
    return float(max(diffs))


def check_structure(outputs, prompts, n: int, max_tokens: int, eos_id: int) -> None:
    assert [o.prompt_ids for o in outputs] == prompts
    for out in outputs:
        assert len(out.completions) == n
        for c in out.completions:
            assert 1 <= len(c.token_ids) <= max_tokens
            assert len(c.rollout_logprobs) == len(c.token_ids)
            assert all(lp <= 0 for lp in c.rollout_logprobs)
            assert c.finish_reason in ("stop", "length")
            if c.finish_reason == "stop":
                assert c.token_ids[-1] == eos_id
            else:
                assert len(c.token_ids) == max_tokens and eos_id not in c.token_ids


def perturb(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {k: v + 0.5 * v.std() * torch.randn(v.shape, generator=gen) for k, v in weights.items()}


class TestTinyQwen2:
    """Untied LM head and q/k/v biases: a bucketed update of every weight matches transformers."""

    def test_weight_update_matches_hf(self):
        path = resolve_model_path("builtin:tiny-qwen2")
        perturbed = perturb(load_file(f"{path}/model.safetensors"))
        hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        hf_model.load_state_dict(perturbed, strict=True)
        prompts, completions = [[1, 2, 3], [7] * 5], [[4, 5, 6, 7], [8, 9]]
        with VLLMEngine(
            path, EngineSettings(dtype="float32", max_model_len=64, in_process=True, max_num_seqs=4)
        ) as engine:
            before = engine.score(prompts, completions)
            push_weights(engine, perturbed.items(), bucket_bytes=2**16)
            after = engine.score(prompts, completions)
        for p, c, b, a in zip(prompts, completions, before, after):
            assert (hf_logprobs(hf_model, p, c) - torch.tensor(a).double()).abs().max() < TINY_ATOL
            assert (torch.tensor(a) - torch.tensor(b)).abs().max() > 0.05


class TestTinyQwen3Moe:
    """Eight experts a layer: every update (not only the first) reaches the CPU backend's grouped-GEMM experts."""

    def test_weight_updates_match_hf(self, tmp_path):
        import shutil

        from safetensors.torch import save_file

        path = resolve_model_path("builtin:tiny-qwen3-moe")
        shutil.copy(f"{path}/config.json", tmp_path)
        original = load_file(f"{path}/model.safetensors")
        prompts, completions = [[1, 2, 3], [7] * 5], [[4, 5, 6, 7], [8, 9]]
        with VLLMEngine(
            path, EngineSettings(dtype="float32", max_model_len=64, in_process=True, max_num_seqs=4)
        ) as engine:
            for update in (perturb(original), original):  # per-expert HF names, as the trainer streams them
                save_file(update, f"{tmp_path}/model.safetensors")  # transformers fuses the experts on load
                hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
                push_weights(engine, update.items(), bucket_bytes=2**16)
                for p, c, a in zip(prompts, completions, engine.score(prompts, completions)):
                    assert (hf_logprobs(hf_model, p, c) - torch.tensor(a).double()).abs().max() < TINY_ATOL


class TestTinyLlama:
    PROMPTS = [[1, 2, 3, 4], [500, 600, 700], [42] * 10]
    SAMPLING = SamplingConfig(temperature=0.8, max_tokens=8, seed=7)

    @pytest.fixture(scope="class")
    def path(self):
        return resolve_model_path("builtin:tiny-llama")

    @pytest.fixture(scope="class")
    def engine(self, path):
        engine = VLLMEngine(path, EngineSettings(dtype="float32", max_model_len=128, in_process=True, max_num_seqs=16))
        yield engine
        engine.close()

    @pytest.fixture(scope="class")
    def hf_model(self, path):
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    def test_generate_matches_hf_logprobs(self, engine, hf_model):
        outputs = engine.generate(self.PROMPTS, 4, self.SAMPLING)
        check_structure(outputs, self.PROMPTS, 4, 8, hf_model.config.eos_token_id)
        assert max_abs_diff(hf_model, self.PROMPTS, outputs, temperature=0.8) < TINY_ATOL

    def test_seed_gives_same_samples(self, engine):
        def tokens(sampling):
            return [[c.token_ids for c in o.completions] for o in engine.generate(self.PROMPTS, 4, sampling)]

        first = tokens(self.SAMPLING)
        assert tokens(self.SAMPLING) == first
        other = tokens(SamplingConfig(temperature=0.8, max_tokens=8, seed=8))
        assert other != first
        for group in first:  # the G samples of one prompt differ from each other
            assert len({tuple(t) for t in group}) > 1

    def test_every_prompt_sample_pair_has_its_own_stream(self, engine):
        """The same prompt twice in one call: 8 different completions (vLLM's n=4 with seeds R, R+1 shared 3)."""
        sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=7)
        outputs = engine.generate([self.PROMPTS[0], self.PROMPTS[0]], 4, sampling)
        assert len({tuple(c.token_ids) for out in outputs for c in out.completions}) == 8

    def test_samples_depend_on_the_global_prompt_index_only(self, engine):
        """A prompt at global index 5 samples the same alone, in a call of 4 or of 8 (engines splitting a batch)."""
        sampling = SamplingConfig(temperature=1.0, max_tokens=8, seed=11)
        prompts = [[3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(8)]

        def tokens(outputs):
            return [[c.token_ids for c in out.completions] for out in outputs]

        whole = tokens(engine.generate(prompts, 4, sampling))
        assert tokens(engine.generate(prompts[5:6], 4, sampling, prompt_indices=[5])) == whole[5:6]
        assert tokens(engine.generate(prompts[4:], 4, sampling, prompt_indices=[4, 5, 6, 7])) == whole[4:]
        assert tokens(engine.generate(prompts[5:6], 4, sampling)) != whole[5:6]  # index 0 is another stream
        with pytest.raises(ValueError, match="distinct indices"):
            engine.generate(prompts[:2], 4, sampling, prompt_indices=[3, 3])

    def test_a_stop_string_inside_a_token_keeps_text_and_ids_one_completion(self, engine, path):
        """The stop string "ste" ends inside the token "uster": the text is what the ids decode to (the reward
        scores the completion the trainer trains on), vLLM's own text would end at "dansuste"."""
        sampling = SamplingConfig(temperature=0.8, max_tokens=8, seed=7, stop=("ste",))
        completion = engine.generate([self.PROMPTS[0]], 1, sampling)[0].completions[0]
        assert completion.token_ids == [18009, 5013, 44612, 5404] and completion.finish_reason == "stop"
        assert completion.text == "comed       dansuster"
        tokenizer = AutoTokenizer.from_pretrained(path)
        assert tokenizer.decode(completion.token_ids, skip_special_tokens=True) == completion.text

    def test_score_matches_hf(self, engine, hf_model):
        completions = [[5, 6, 7], [8, 9, 10, 11], [12]]
        scores = engine.score(self.PROMPTS, completions)
        for p, c, s in zip(self.PROMPTS, completions, scores):
            assert len(s) == len(c)
            assert (hf_logprobs(hf_model, p, c) - torch.tensor(s).double()).abs().max() < TINY_ATOL

    def test_prompt_too_long_is_rejected(self, engine):
        with pytest.raises(ValueError, match="max_model_len=128"):
            engine.generate([[1] * 125], 1, self.SAMPLING)

    def test_weight_update_changes_logprobs_like_hf(self, engine, hf_model, path):
        original = load_file(f"{path}/model.safetensors")
        completions = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14], [15, 16]]
        before = engine.score(self.PROMPTS, completions)

        perturbed = perturb(original)
        qkv_bytes = sum(original[f"model.layers.0.self_attn.{p}_proj.weight"].nbytes for p in "qk")
        # budget below q+k of one layer, so buckets end between q_proj and k_proj (and inside the MLP).
        stats = push_weights(engine, perturbed.items(), bucket_bytes=qkv_bytes - 1)
        assert stats.num_tensors == len(original) and stats.num_buckets > 4

        hf_model.load_state_dict(perturbed, strict=False)
        after = engine.score(self.PROMPTS, completions)
        for p, c, b, a in zip(self.PROMPTS, completions, before, after):
            assert (hf_logprobs(hf_model, p, c) - torch.tensor(a).double()).abs().max() < TINY_ATOL
            assert (torch.tensor(a) - torch.tensor(b)).abs().max() > 0.05

        # Zero the final norm: every logit is 0, so every sampled token has log-prob -ln(V) at any temperature.
        engine.update_weights([("model.norm.weight", torch.zeros_like(original["model.norm.weight"]))])
        uniform = -math.log(hf_model.config.vocab_size)
        for out in engine.generate(self.PROMPTS, 2, self.SAMPLING):
            for c in out.completions:
                assert max(abs(lp - uniform) for lp in c.rollout_logprobs) < 1e-5

        engine.update_weights(original.items())  # restoring the checkpoint restores the scores
        hf_model.load_state_dict(original, strict=False)
        restored = engine.score(self.PROMPTS, completions)
        for b, r in zip(before, restored):
            assert max(abs(x - y) for x, y in zip(b, r)) < 1e-5

    def test_bad_updates_are_rejected_and_change_nothing(self, engine, path):
        weights = load_file(f"{path}/model.safetensors")
        before = engine.score(self.PROMPTS[:1], [[5, 6, 7]])
        w = weights["model.norm.weight"]
        with pytest.raises(ValueError, match="appears twice"):
            engine.update_weights([("model.norm.weight", w * 2), ("model.norm.weight", w)])
        k = weights["model.layers.1.self_attn.k_proj.weight"]
        with pytest.raises(
            ValueError,
            match=r"missing \['model.layers.1.self_attn.q_proj.weight', "
            r"'model.layers.1.self_attn.v_proj.weight'\]",
        ):
            engine.update_weights([("model.layers.1.self_attn.k_proj.weight", k * 2)])
        assert engine.score(self.PROMPTS[:1], [[5, 6, 7]]) == before
