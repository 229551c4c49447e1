"""Device discipline of the package's collectives (each on its group's device), by a source scan and by a recorded run.

The rule: every collective the package issues goes through ``parallel/collectives.py``, which runs it on the group's
device (CUDA for NCCL), so the trainer's CPU tensors cannot reach an NCCL group; the weight gather
(``megatron_adapter/hf_stream.py``) is the one other caller. A direct call elsewhere is what crashed every GPU run
at the end of step 1 (the stop flag's CPU tensor on NCCL).

* the scan reads every package module (``ast``; nothing is imported) and lists the calls of a ``torch.distributed``
  collective outside those two files;
* the recorded run is a real ``Trainer.run`` of one step (the real ``MegatronPolicy`` on ``builtin:tiny-llama``, the
  fake rollout engine, a checkpoint save) on 2 gloo ranks, at TP=2 and at PP=2: every collective is recorded
  (``tests/helpers/collective_recorder.py``) and each package call must come from the allowed files with its
  tensors on the group's declared device. ``tests/gpu/gpu_checks.py`` runs the same check on NCCL.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.helpers.collective_recorder import ALLOWED_CALLERS, COLLECTIVES, CollectiveCall, violations
from tests.helpers.dist_harness import run_distributed

ROOT = Path(__file__).resolve().parents[2]


def _distributed_aliases(tree: ast.AST) -> tuple[set[str], set[str]]:
    """Names bound to the ``torch.distributed`` module (``torch`` counts through ``torch.distributed``), and names
    bound to one of its collectives by ``from torch.distributed import ...``."""
    modules, functions = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
                elif alias.name.split(".")[0] == "torch":
                    modules.add("torch.distributed")
        elif isinstance(node, ast.ImportFrom) and node.module == "torch":
            modules.update(a.asname or a.name for a in node.names if a.name == "distributed")
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            functions.update(a.asname or a.name for a in node.names if a.name in COLLECTIVES)
    return modules, functions


def direct_collective_calls(root: Path) -> list[str]:
    """``path:line name`` of every call of a ``torch.distributed`` collective in ``root/gtpo_megatron`` outside the
    allowed files (``dist.all_reduce(...)``, ``torch.distributed.barrier(...)``, an imported ``broadcast(...)``)."""
    found = []
    for path in sorted((root / "gtpo_megatron").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative in ALLOWED_CALLERS:
            continue
        tree = ast.parse(path.read_text())
        modules, functions = _distributed_aliases(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in COLLECTIVES:
                owner = ast.unparse(func.value)
                if any(owner == m or owner.startswith(m + ".") for m in modules):
                    found.append(f"{relative}:{node.lineno} {func.attr}")
            elif isinstance(func, ast.Name) and func.id in functions:
                found.append(f"{relative}:{node.lineno} {func.id}")
    return found


def test_collective_device_no_direct_calls_outside_the_collectives_module():
    offenders = direct_collective_calls(ROOT)
    assert offenders == [], f"call these through gtpo_megatron/parallel/collectives.py: {offenders}"


def test_collective_device_scan_finds_every_spelling(tmp_path):
    import torch.distributed as dist

    assert [name for name in COLLECTIVES if not callable(getattr(dist, name, None))] == []
    package = tmp_path / "gtpo_megatron"
    (package / "parallel").mkdir(parents=True)
    (package / "parallel" / "collectives.py").write_text("import torch.distributed as dist\ndist.all_reduce(x)\n")
    (package / "bad.py").write_text(
        "import torch\nimport torch.distributed as d\nfrom torch import distributed\n"
        "from torch.distributed import broadcast_object_list as bol, get_rank\n"
        "def f(x):\n    d.all_reduce(x)\n    torch.distributed.barrier()\n    distributed.send(x, 1)\n"
        "    bol([x], src=0)\n    d.get_rank()\n    get_rank()\n    d.group.WORLD\n"
        "    torch.distributed.distributed_c10d.all_gather_object([], x)\n"
    )
    assert direct_collective_calls(tmp_path) == [
        "gtpo_megatron/bad.py:6 all_reduce",
        "gtpo_megatron/bad.py:7 barrier",
        "gtpo_megatron/bad.py:8 send",
        "gtpo_megatron/bad.py:9 bol",
        "gtpo_megatron/bad.py:13 all_gather_object",
    ]


def test_collective_device_violations_name_the_caller_and_the_devices():
    def call(caller: str, devices=("cpu",), declared="cpu", origin="package") -> CollectiveCall:
        return CollectiveCall(name="all_reduce", origin=origin, caller=caller, devices=devices, declared=declared)

    calls = [
        call("gtpo_megatron/parallel/collectives.py:60"),
        call("gtpo_megatron/megatron_adapter/hf_stream.py:59", devices=("cuda:0", "cuda:0"), declared="cuda:0"),
        call("/site-packages/megatron/core/x.py:3", devices=("cpu",), declared="cuda:0", origin="megatron"),
        call("gtpo_megatron/trainer.py:250", declared="cuda:0"),
        call("gtpo_megatron/parallel/collectives.py:60", devices=("cpu",), declared="cuda:0"),
    ]
    assert violations(calls) == [
        "gtpo_megatron/trainer.py:250: calls torch.distributed.all_reduce directly; use parallel.collectives",
        "gtpo_megatron/trainer.py:250: all_reduce with tensors on ['cpu'], its group's device is cuda:0",
        "gtpo_megatron/parallel/collectives.py:60: all_reduce with tensors on ['cpu'], its group's device is cuda:0",
    ]


def _recorded_run(rank: int, world_size: int, out_dir: str) -> None:
    from gtpo_megatron.build import build_policy
    from gtpo_megatron.builtin_models import resolve_model_path
    from gtpo_megatron.config import load_config
    from gtpo_megatron.parallel.groups import init_distributed
    from tests.helpers.collective_recorder import CollectiveRecorder
    from tests.trainer.fakes import fake_rollout_trainer

    for tp, pp in ((2, 1), (1, 2)):
        cfg = load_config(None, [
            "model=builtin:tiny-llama", "model.params_dtype=float32", f"output_dir={out_dir}/tp{tp}_pp{pp}",
            f"parallel.tp_size={tp}", f"parallel.pp_size={pp}", "rollout.num_prompts=2", "algorithm.group_size=4",
            "optim.micro_batch_size=4", "trainer.max_steps=1", "logging.wandb_mode=disabled",
        ])  # fmt: skip
        groups = init_distributed(tp_size=tp, pp_size=pp)
        policy = build_policy(cfg, resolve_model_path(cfg.model.name_or_path), groups)
        trainer = fake_rollout_trainer(cfg, groups=groups, policy=policy)
        with CollectiveRecorder() as recorder:
            trainer.run()  # one step, the stop flag, a checkpoint save
        trainer.close()
        label = f"rank {rank} tp={tp} pp={pp}"
        problems = violations(recorder.calls)
        assert problems == [], f"{label}: " + "; ".join(problems)
        package = {c.name for c in recorder.calls if c.origin == "package"}
        # the rollout exchange and the stop flags (all_reduce), the save (barrier), the PP weight gather (broadcast)
        expected = {"all_reduce", "barrier"} | ({"broadcast"} if pp > 1 else set())
        assert expected <= package, (label, package)  # the recorder saw the package's own calls ...
        assert any(c.origin == "megatron" for c in recorder.calls), label  # ... and Megatron's


@pytest.mark.distributed
def test_collective_device_trainer_run_on_gloo_tp2_and_pp2(tmp_path):
    run_distributed(_recorded_run, 2, str(tmp_path))
