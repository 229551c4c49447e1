"""Rollout: typed containers and the generation engines (vLLM the real one, imported by its engine modules only)."""
