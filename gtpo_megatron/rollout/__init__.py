"""Rollout: typed containers and the generation engines (vLLM is the real one; only vllm_engine imports vllm)."""
