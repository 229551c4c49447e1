"""``build_rollout.py``'s engine wiring: which engines a job gets and the environment of each engine's processes."""

from __future__ import annotations

import os
import threading

import pytest

from gtpo_megatron.build import _in_background
from gtpo_megatron.build_rollout import bind_training_rank, build_placements, engine_environment
from gtpo_megatron.config import load_config
from gtpo_megatron.logging import PhaseTimer

BASE = ["model=builtin:tiny-qwen2", "output_dir=/tmp/unused"]


def _cfg(*overrides):
    return load_config(None, [*BASE, *overrides])


def test_separate_engine_processes_see_only_the_gpus_training_leaves(monkeypatch):
    """Separate placement: 6 training ranks on an 8-GPU node, engine TP 2 -> CUDA_VISIBLE_DEVICES=6,7."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    cfg = _cfg("rollout.placement=separate", "rollout.engine_tp_size=2", "parallel.tp_size=2")
    (only,) = build_placements(cfg, 6)
    assert engine_environment(only, [only], cfg, 6) == {"CUDA_VISIBLE_DEVICES": "6,7"}
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    colocated = build_placements(_cfg("rollout.engine_tp_size=2", "parallel.tp_size=2"), 8)  # auto: 4 engines
    assert [engine_environment(p, colocated, cfg, 8) for p in colocated] == [
        {"CUDA_VISIBLE_DEVICES": devices} for devices in ("0,1", "2,3", "4,5", "6,7")
    ]


def test_cpu_engines_sharing_a_node_get_their_own_cores(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    cfg = _cfg("rollout.num_engines=2")
    placements = build_placements(cfg, 2)
    assert [p.leader_rank for p in placements] == [0, 1]
    assert [engine_environment(p, placements, cfg, 2) for p in placements] == [
        {"VLLM_CPU_OMP_THREADS_BIND": "0"},
        {"VLLM_CPU_OMP_THREADS_BIND": "1"},
    ]
    (alone,) = build_placements(_cfg(), 2)  # auto on CPU: one engine, vLLM's own binding
    assert engine_environment(alone, [alone], cfg, 2) == {}


def test_the_files_path_refuses_several_engines(monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    cfg = _cfg("rollout.weight_sync=files")
    with pytest.raises(ValueError, match="rollout.weight_sync=files feeds one engine, but rollout.num_engines=auto"
                                         " gives 8 here"):  # fmt: skip
        build_placements(cfg, 8)
    assert len(build_placements(_cfg("rollout.weight_sync=files", "rollout.num_engines=1"), 8)) == 1


def test_engine_gpus_follow_the_nodes_visible_devices(monkeypatch):
    """A node whose job was given GPUs 8-15 of 16: the engine on local GPUs 6 and 7 gets the physical 14 and 15."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", ",".join(str(g) for g in range(8, 16)))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "6")
    cfg = _cfg("rollout.placement=separate", "rollout.engine_tp_size=2", "parallel.tp_size=2")
    (only,) = build_placements(cfg, 6)
    assert engine_environment(only, [only], cfg, 6) == {"CUDA_VISIBLE_DEVICES": "14,15"}


def test_cpu_engines_on_two_nodes_keep_their_nodes_cores(monkeypatch):
    """Two nodes of one rank each (``LOCAL_WORLD_SIZE=1``): one engine per node, alone there, so no binding."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    cfg = _cfg("rollout.num_engines=2")
    placements = build_placements(cfg, 2)
    assert [p.leader_rank for p in placements] == [0, 1]
    assert [engine_environment(p, placements, cfg, 2) for p in placements] == [{}, {}]


def test_a_separate_cpu_engine_and_the_training_rank_get_disjoint_cores(monkeypatch):
    """The CPU demo's layout: one training rank and one separate engine on a 2-core node -> one core each."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    bound, threads = [], []
    monkeypatch.setattr("os.sched_setaffinity", lambda task, cores: bound.append((task, tuple(cores))))
    monkeypatch.setattr("torch.set_num_threads", threads.append)
    cfg = _cfg("rollout.placement=separate")
    placements = build_placements(cfg, 1)
    assert engine_environment(placements[0], placements, cfg, 1) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert bind_training_rank(cfg, placements, 0, 1) == ((0,), (1,))  # (the rank's cores, its engine's)
    assert threading.get_native_id() in {task for task, _ in bound}  # every thread of the process, this one too
    assert {cores for _, cores in bound} == {(0,)} and threads == [1]
    colocated = _cfg()  # one colocated engine: the rank waits while it generates, vLLM binds it
    assert engine_environment(placements[0], placements, colocated, 1) == {}
    assert bind_training_rank(colocated, placements, 0, 1) is None


def test_the_rollout_side_thread_runs_on_the_engines_cores_and_the_rank_keeps_its_own():
    cores = sorted(os.sched_getaffinity(0))
    seen = _in_background(PhaseTimer(), "startup/x", lambda: os.sched_getaffinity(0), cores={cores[-1]}).result()
    assert seen == {cores[-1]} and sorted(os.sched_getaffinity(0)) == cores
