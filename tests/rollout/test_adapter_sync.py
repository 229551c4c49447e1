"""``rollout/adapter_sync.py:AdapterWeightSync`` on 2 gloo ranks, each leading a recording engine.

Rank 0 alone gathers (a stand-in for ``lora_gather``: fixed tensors) and broadcasts; each rank writes a PEFT folder in
its own staging root and its engine loads it. Checked per sync: both engines got the same tensors under the same
version, the folders are complete when loaded and the previous version's is gone afterwards, the metrics (rank 0
only) count the adapters' bytes, and the staging folder goes at close. Single process: the same without the
broadcast (``world=None``), and a failed load marks the guarded engine unusable, naming it.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gtpo_megatron.rollout.adapter_sync import AdapterWeightSync
from gtpo_megatron.rollout.peft_adapter import CONFIG_FILE, WEIGHTS_FILE, AdapterSpec, tensor_key
from tests.helpers.dist_harness import run_distributed

SPEC = AdapterSpec(rank=2, alpha=4, projections=("q_proj",))


def _tensors(version: int) -> dict[str, torch.Tensor]:
    return {tensor_key(0, "q_proj", "A"): torch.full((2, 8), float(version)),
            tensor_key(0, "q_proj", "B"): torch.full((8, 2), -float(version))}  # fmt: skip


class RecordingEngine:
    """Keeps what each ``load_adapter`` call found in its folder."""

    def __init__(self):
        self.loads: list[tuple[int, str, dict]] = []

    def load_adapter(self, folder: str) -> int:
        from safetensors.torch import load_file

        assert sorted(p.name for p in Path(folder).iterdir()) == [CONFIG_FILE, WEIGHTS_FILE]
        self.loads.append((len(self.loads) + 1, folder, load_file(f"{folder}/{WEIGHTS_FILE}")))
        return len(self.loads)


def _run(sync: AdapterWeightSync, engine: RecordingEngine, rank: int, versions: int) -> list[dict]:
    metrics = []
    for version in range(1, versions + 1):
        sync.gather = lambda version=version: _tensors(version)
        metrics.append(sync.sync(stream=None))
        folder = engine.loads[-1][1]
        loaded, expected = engine.loads[-1][2], _tensors(version)
        assert Path(folder).is_dir() and loaded.keys() == expected.keys(), (rank, version)
        assert all(torch.equal(loaded[key], expected[key]) for key in expected), (rank, version)
        assert version == 1 or not Path(engine.loads[-2][1]).exists(), "the previous version's folder is removed"
    return metrics


def _worker(rank: int, world_size: int, root: str) -> None:
    import torch.distributed as dist

    engine = RecordingEngine()
    Path(f"{root}/node{rank}").mkdir()
    sync = AdapterWeightSync(engine=engine, gather=dict, exporting=rank == 0, is_sender=rank == 0, spec=SPEC,
                             world=dist.group.WORLD, staging_dir=f"{root}/node{rank}")  # fmt: skip
    metrics = _run(sync, engine, rank, versions=3)
    if rank == 0:
        assert [m["sync/adapter_version"] for m in metrics] == [1.0, 2.0, 3.0]
        assert all(m["sync/bytes"] == 2 * 16 * 4 and m["sync/num_tensors"] == 2 for m in metrics)
    else:
        assert metrics == [{}, {}, {}]
    staging = sync._staging
    sync.close()
    assert not staging.exists()


def test_two_leaders_serve_the_same_versions(tmp_path):
    run_distributed(_worker, 2, str(tmp_path))


def test_single_leader_and_a_failed_load(tmp_path):
    from gtpo_megatron.plan.engines import EnginePlacement
    from gtpo_megatron.rollout.engine_guard import EngineFailure, GuardedEngine

    engine = RecordingEngine()
    sync = AdapterWeightSync(engine=engine, gather=dict, exporting=True, is_sender=True, spec=SPEC, world=None,
                             staging_dir=str(tmp_path))  # fmt: skip
    assert [m["sync/bytes"] for m in _run(sync, engine, 0, versions=2)] == [128.0, 128.0]

    class Broken:
        def load_adapter(self, folder):
            raise RuntimeError("no LoRA support")

    placement = EnginePlacement(index=0, num_engines=1, leader_rank=0, ranks=(0,), devices=())
    guarded = GuardedEngine(Broken(), placement=placement, timeout_s=30)
    failing = AdapterWeightSync(engine=guarded, gather=lambda: _tensors(1), exporting=True, is_sender=True,
                                spec=SPEC, world=None, staging_dir=str(tmp_path))  # fmt: skip
    with pytest.raises(EngineFailure, match="adapter update failed .*no LoRA support"):
        failing.sync()
    assert guarded.unusable is not None
