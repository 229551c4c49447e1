"""gtpo-plan end to end: every large recipe fits at its GPU count, broken layouts and overfull GPUs exit 2."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from gtpo_megatron.plan_cli import run

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SCALE_RECIPES = sorted(CONFIGS.glob("*_gtpo_*gpu.yaml"))
GIB = 2**30


def _gpus(path: Path) -> int:
    return int(re.search(r"_(\d+)gpu$", path.stem).group(1))


def _row(text: str, label: str) -> list[float]:
    """Numbers of one table row (GiB)."""
    line = next(line for line in text.splitlines() if line.startswith(label))
    return [float(v) for v in line[34:].split()]


def test_recipes_cover_three_models_and_8_32_64_gpus() -> None:
    stems = {p.stem for p in SCALE_RECIPES}
    assert {"qwen2.5-32b_gsm8k_gtpo_8gpu", "qwen2.5-32b_gsm8k_gtpo_32gpu", "qwen2.5-32b_gsm8k_gtpo_64gpu",
            "qwen3-32b_math_gtpo_32gpu", "qwen3-32b_math_gtpo_64gpu", "llama3.1-70b_gsm8k_gtpo_32gpu",
            "llama3.1-70b_math_gtpo_32gpu", "llama3.1-70b_gsm8k_gtpo_64gpu",
            "llama3.1-70b_math_gtpo_64gpu"} <= stems  # fmt: skip


@pytest.mark.parametrize("path", [p for p in SCALE_RECIPES if _gpus(p) > 8], ids=lambda p: p.stem)
def test_recipe_fits_at_its_gpu_count(path: Path) -> None:
    status, text = run(["--config", str(path), "--gpus", str(_gpus(path)), "--gpu-mem", "80"])
    assert status == 0, text
    assert "per-GPU memory (GiB)" in text and "fits:" in text
    usable = 80 - 4
    assert max(_row(text, "training phase total")) <= usable
    assert max(_row(text, "rollout phase total")) <= usable


def test_8gpu_recipe_needs_train_state_offload() -> None:
    path = CONFIGS / "qwen2.5-32b_gsm8k_gtpo_8gpu.yaml"
    args = ["--config", str(path), "--gpus", "8", "--gpu-mem", "80"]
    status, text = run([*args, "rollout.offload_train_state=false"])
    assert status == 2
    assert "rollout.offload_train_state=true" in text
    status, text = run(args)  # the recipe sets it
    assert status == 0, text
    # dp 1: 18 bytes per parameter stay on the GPU for training, 68.7 GiB of the 32.76B model over 8 GPUs
    assert _row(text, "training phase total")[0] > 68.7


def test_table_values_match_hand_numbers_for_llama70b() -> None:
    status, text = run(["--config", str(CONFIGS / "llama3.1-70b_math_gtpo_64gpu.yaml"), "--gpus", "64"])
    assert status == 0, text
    # tests/plan/test_memory.py: 2,271,543,296 params on stage 0 -> 4,543,086,592 bytes of bf16 weights
    assert _row(text, "weights") == [round(4_543_086_592 / GIB, 2), round(4_543_086_592 / GIB, 2)]
    assert _row(text, "optimizer (Adam + fp32 master)")[0] == round(13_629_259_776 / GIB, 2)
    assert "padded 129024" in text and "tp 8 x pp 4 x dp 2" in text and "2.82 s at 400 Gbit/s" in text


def test_kl_reference_row_and_offload() -> None:
    path = str(CONFIGS.parent / "configs" / "llama3.1-8b-instruct_math_grpo.yaml")
    status, text = run(["--config", path, "--gpus", "8"])  # GRPO with beta = 1e-6: a frozen reference
    assert status == 0, text
    assert _row(text, "KL reference weights") == _row(text, "weights")  # the same bf16 stage, once more
    status, text = run(["--config", path, "--gpus", "8", "algorithm.kl_reference_offload=true"])
    assert status == 0 and "KL reference weights" not in text


def test_layout_that_does_not_divide_exits_2_with_reason() -> None:
    path = CONFIGS / "llama3.1-70b_gsm8k_gtpo_64gpu.yaml"
    status, text = run(["--config", str(path), "--gpus", "60", "parallel.tp_size=16"])
    assert status == 2
    assert "parallel.tp_size=16 must divide num_attention_heads=64 and num_query_groups=8" in text
    assert "--gpus=60" in text


def test_layout_that_does_not_fit_exits_2_with_reason() -> None:
    # 70B on 16 GPUs: tp 8 x pp 2 x dp 1 keeps 18 bytes x 4.41e9 params = 74 GiB before activations
    path = CONFIGS / "llama3.1-70b_math_gtpo_32gpu.yaml"
    status, text = run(["--config", str(path), "--gpus", "16", "parallel.pp_size=2"])
    assert status == 2
    assert "training phase needs" in text
    # the recipe already uses the distributed optimizer and sequence parallelism: only the unused savers are offered
    assert (
        "try model.recompute=full, optim.max_tokens_per_micro_batch=5500 (one full-length sequence), more GPUs" in text
    )
    assert "use_distributed_optimizer" not in text.split("does not fit")[1]


def test_bad_config_key_exits_2() -> None:
    status, text = run(["--config", str(CONFIGS / "qwen3-32b_math_gtpo_64gpu.yaml"), "--gpus", "64",
                        "parallel.tp=4"])  # fmt: skip
    assert status == 2 and "parallel.tp" in text


def test_local_builtin_model_is_read_from_its_config() -> None:
    # SmolLM2-135M: 9 heads / 3 KV heads, so tp 2 cannot divide them unless the heads are padded
    demo = str(CONFIGS / "cpu_demo.yaml")
    status, text = run(["--config", demo, "--gpus", "2", "parallel.tp_size=2", "model.pad_attention_heads=false"])
    assert status == 2 and "num_attention_heads=9" in text and "model.pad_attention_heads=true" in text
    status, _ = run(["--config", demo, "--gpus", "2", "parallel.tp_size=2", "model.pad_attention_heads=true"])
    assert status == 0


def test_console_script_exit_status() -> None:
    path = CONFIGS / "llama3.1-70b_gsm8k_gtpo_32gpu.yaml"
    ok = subprocess.run([sys.executable, "-m", "gtpo_megatron.plan_cli", "--config", str(path), "--gpus", "32"],
                        capture_output=True, text=True)  # fmt: skip
    assert ok.returncode == 0 and "training phase total" in ok.stdout
    bad = subprocess.run([sys.executable, "-m", "gtpo_megatron.plan_cli", "--config", str(path), "--gpus", "30"],
                         capture_output=True, text=True)  # fmt: skip
    assert bad.returncode == 2 and "--gpus=30" in bad.stderr


def test_separate_placement_gives_the_engine_its_own_gpus() -> None:
    path = CONFIGS / "llama3.1-70b_math_gtpo_32gpu.yaml"
    status, text = run(["--config", str(path), "--gpus", "40", "rollout.placement=separate",
                        "rollout.gpu_memory_utilization=0.9"])  # fmt: skip
    assert status == 0, text
    assert "train 32 = tp 8 x pp 4 x dp 1" in text and "engine GPU" in text
    # 0.9 * 80 GiB budget on the engine's own GPUs, 70.55e9 * 2 bytes / 8 of weights
    assert _row(text, "engine GPU total (vLLM budget)") == [72.0]
    assert _row(text, "vLLM weights (engine TP shard)") == [round(70_553_706_496 * 2 / 8 / GIB, 2)]
    status, text = run(["--config", str(path), "--gpus", "40", "rollout.placement=separate"])
    assert status == 0  # the 40 % budget of the colocated recipe also fits on a GPU of its own


def test_train_state_offload_leaves_only_weights_during_rollout() -> None:
    from gtpo_megatron.plan.memory import StageMemory, TrainingShape
    from gtpo_megatron.plan_cli import rollout_resident, training_fixes

    stage = StageMemory(stage=0, params=10, weights=20, grads=40, optimizer=120, activations=7, logits=3)
    assert rollout_resident(stage, offload=False) == 180 and rollout_resident(stage, offload=True) == 20
    with_reference = StageMemory(stage=0, params=10, weights=20, grads=40, optimizer=120, activations=7, logits=3,
                                 reference=20)  # fmt: skip
    assert rollout_resident(with_reference, offload=False) == 200 and rollout_resident(with_reference, True) == 40
    bare = TrainingShape(tp_size=2, pp_size=1, dp_size=2, micro_batch_size=2, seq_length=8, num_microbatches=1)
    assert training_fixes(bare) == (
        "try parallel.use_distributed_optimizer=true, model.recompute=full, parallel.sequence_parallel=true, "
        "algorithm.logprob_chunk_size=1024, a smaller optim.micro_batch_size, more GPUs or a larger "
        "parallel.tp_size*parallel.pp_size")  # fmt: skip


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--gpus", "0"], "--gpus=0: must be >= 1"),
        (["--gpus", "32", "--gpu-mem", "-1"], "--gpu-mem=-1: must be > 0 GiB"),
        (["--gpus", "32", "--gpus-per-node", "0"], "--gpus-per-node=0: must be >= 1"),
        (["--gpus", "32", "--reserve-gib", "100"], "--reserve-gib=100: must be in [0, --gpu-mem=80)"),
        (["--gpus", "32", "--sync-bandwidth-gbps", "0"], "--sync-bandwidth-gbps=0: must be > 0"),
    ],
)
def test_bad_flags_exit_2_naming_the_flag(flags, fragment) -> None:
    status, text = run(["--config", str(CONFIGS / "qwen2.5-32b_gsm8k_gtpo_32gpu.yaml"), *flags])
    assert status == 2 and fragment in text, text


def test_yaml_syntax_error_exits_2(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  name_or_path: x\n  bad: [1, 2\noutput_dir: y\n")
    status, text = run(["--config", str(bad), "--gpus", "8"])
    assert status == 2 and "invalid YAML at line 4" in text


def test_plan_imports_no_torch() -> None:
    """gtpo-plan runs where torch is not installed: the policy settings it reports on are torch-free."""
    probe = "import sys, gtpo_megatron.plan_cli; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], cwd=CONFIGS.parent, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-2000:]


def test_plan_refuses_what_the_policy_cannot_build() -> None:
    recipe = str(SCALE_RECIPES[0])
    status, text = run(["--config", recipe, "--gpus", str(_gpus(SCALE_RECIPES[0])), "model.params_dtype=float16"])
    assert status == 2 and "model.params_dtype='float16': must be one of ['float32', 'bfloat16']" in text


def test_many_engines_and_the_sync_path_of_the_70b_recipe() -> None:
    path = CONFIGS / "llama3.1-70b_gsm8k_gtpo_64gpu.yaml"
    status, text = run(["--config", str(path), "--gpus", "64", "--gpu-mem", "80"])
    assert status == 0, text
    assert "vLLM 8 x engine tp 8 (colocated)" in text
    # 64 prompts over 8 engines: 8 whole groups of 8 sequences each; KV 40 KiB/token/GPU * 5500 tokens * 64
    assert "64 rollout sequences per engine need 13.43 GiB" in text
    # 70.55e9 parameters * 2 bytes (bfloat16) * 8 bits / 400e9 bit/s = 2.82 s
    assert (
        "weight sync (collective: NCCL broadcast of buckets from rank 0 to the 64 engine workers, the one on rank 0's "
        "GPU through a relay; pipelined, so about one pass over the slowest link): 141.1 GB (bfloat16) per sync, "
        "2.82 s at 400 Gbit/s (--sync-bandwidth-gbps); rollout.weight_sync=collective (auto: sharded does not apply "
        "with GPUs)"
    ) in text
    # the path a GPU run takes is the planner's too: an explicit sharded is refused as at start-up
    status, text = run(["--config", str(path), "--gpus", "64", "rollout.weight_sync=sharded"])
    assert status == 2 and "rollout.weight_sync='sharded': its wire is gloo over TCP" in text
    status, text = run(["--config", str(path), "--gpus", "64", "rollout.num_engines=1", "rollout.weight_sync=files"])
    assert "vLLM 1 x engine tp 8" in text and "512 rollout sequences per engine" in text
    # the files path writes and reads every byte once: 2 * 141.1 GB at 16 Gbit/s = 141.1 s
    assert "weight sync (files: " in text and "141.11 s assuming 16 Gbit/s for each pass" in text
    status, text = run(["--config", str(path), "--gpus", "64", "rollout.num_engines=3"])
    assert status == 2 and "rollout.num_engines=3 x rollout.engine_tp_size=8 = 24 GPUs must divide" in text
