"""gtpo_megatron: GTPO (Simoni et al., TACL 2026) for Megatron-Core with vLLM rollouts.

Importing this package imports neither megatron nor vllm; those load only in the modules that need them
(``megatron_adapter``, ``rollout.vllm_engine``).
"""

__version__ = "0.1.0"
