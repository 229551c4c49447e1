"""Where the vLLM engines of a run live and which prompts each one samples (torch-free arithmetic, one owner).

A run has ``num_engines`` engines of ``engine_tp_size`` workers each; every engine is started and driven by one
training rank, its *leader* (the engine's workers are processes of their own, spawned by vLLM).

- ``colocated``: engine ``i`` shares the GPUs of the training ranks ``[i*s, i*s + engine_tp)`` with
  ``s = world / num_engines`` (``auto``: ``num_engines = world / engine_tp``, so ``s = engine_tp`` and every GPU
  generates); its leader is the first of those ranks. The ranks of one engine must be on one node.
- ``separate``: the engines take the ``num_engine_gpus`` GPUs that training does not use, spread evenly over the
  nodes (torchrun starts ``ranks_per_node`` training ranks per node, so the engine GPUs of a node are the local
  devices ``ranks_per_node, ranks_per_node + 1, ...``); the k-th engine of a node is led by that node's local
  rank k. Example: 6 training ranks on 8 GPUs with engine TP 2 -> one engine on GPUs 6 and 7, led by rank 0.
- CPU: ``auto`` is one engine; N engines are led by the ranks ``0, W/N, 2W/N, ...``. Colocated engines sharing a
  node bind their OpenMP threads to shares of its cores of their own; separate engines and the node's training
  ranks get disjoint shares (:func:`split_cores`), so that generation and training compete for no core.

A step's P prompts are dealt to the engines as whole groups, in contiguous balanced blocks
(:func:`engine_prompt_range`); request seeds depend on the global prompt index only, so the completions do not
depend on the number of engines.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Placement = Literal["colocated", "separate"]


@dataclass(frozen=True, kw_only=True, slots=True)
class EnginePlacement:
    """One engine's place: ``ranks`` whose GPUs it shares (``(leader_rank,)`` if separate), node-local ``devices``.

    ``devices``: node-local indices of its workers' GPUs (:func:`visible_devices`), empty on CPU.
    """

    index: int
    num_engines: int
    leader_rank: int
    ranks: tuple[int, ...]
    devices: tuple[int, ...]

    def describe(self) -> str:
        """``"engine 1 of 2 (leader rank 2, ranks [2, 3], GPUs [2, 3])"`` for logs and error messages."""
        gpus = f", GPUs {list(self.devices)}" if self.devices else ""
        return (
            f"engine {self.index} of {self.num_engines} (leader rank {self.leader_rank}, ranks {list(self.ranks)}"
            f"{gpus})"
        )


def engine_pool_gpus(*, placement: Placement, engine_tp_size: int, num_engine_gpus: int | None) -> int:
    """GPUs the engines take outside the training world: ``num_engine_gpus`` (null: engine TP) if separate, else 0."""
    if placement == "colocated":
        return 0
    return engine_tp_size if num_engine_gpus is None else num_engine_gpus


def resolve_num_engines(
    num_engines: int | Literal["auto"],
    *,
    placement: Placement,
    train_world_size: int,
    engine_tp_size: int,
    num_engine_gpus: int | None,
    accelerator: bool,
) -> int:
    """``rollout.num_engines`` as a number: ``auto`` fills the GPUs (module docstring), or 1 without GPUs."""
    if num_engines != "auto":
        return int(num_engines)
    if not accelerator:
        return 1
    if placement == "colocated":
        return max(train_world_size // engine_tp_size, 1)
    pool = engine_pool_gpus(placement=placement, engine_tp_size=engine_tp_size, num_engine_gpus=num_engine_gpus)
    return max(pool // engine_tp_size, 1)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def engine_count_problems(
    num_engines: int, *, placement: Placement, train_world_size: int, engine_tp_size: int, pool_gpus: int
) -> list[str]:
    """Reasons ``num_engines * engine_tp_size`` does not divide the training world (colocated) or ``pool_gpus``."""
    if num_engines < 1:
        return [f"rollout.num_engines={num_engines} must be >= 1 or auto"]
    span, where = (train_world_size, "the world size") if placement == "colocated" else (pool_gpus, "the engine pool")
    if span % (num_engines * engine_tp_size) == 0:
        return []
    fits = [n for n in _divisors(max(span // engine_tp_size, 1)) if span % (n * engine_tp_size) == 0]
    return [
        f"rollout.num_engines={num_engines} x rollout.engine_tp_size={engine_tp_size} = "
        f"{num_engines * engine_tp_size} GPUs must divide {where} ({span}, rollout.placement={placement}); "
        f"use rollout.num_engines=auto or one of {fits}"
    ]


def engine_prompt_range(num_prompts: int, *, num_engines: int, index: int) -> range:
    """Global prompt indices of engine ``index``: contiguous blocks differing by at most one (the first take more)."""
    base, extra = divmod(num_prompts, num_engines)
    start = index * base + min(index, extra)
    return range(start, start + base + (index < extra))


def engine_placements(
    *,
    placement: Placement,
    num_engines: int,
    engine_tp_size: int,
    train_world_size: int,
    ranks_per_node: int,
    pool_gpus: int,
    accelerator: bool,
) -> list[EnginePlacement]:
    """Leader, ranks and devices of every engine (module docstring), the same list on every rank.

    ``ranks_per_node`` is torchrun's ``LOCAL_WORLD_SIZE``; ``pool_gpus`` :func:`engine_pool_gpus`.

    Raises:
        ValueError: the counts do not tile (:func:`engine_count_problems`), an engine would span two nodes, or a
            node has more separate engines than training ranks to lead them.
    """
    problems = engine_count_problems(
        num_engines,
        placement=placement,
        train_world_size=train_world_size,
        engine_tp_size=engine_tp_size if accelerator else 1,
        pool_gpus=pool_gpus,
    )
    if problems:
        raise ValueError("; ".join(problems))
    if not accelerator:
        stride = train_world_size // num_engines
        return [EnginePlacement(index=i, num_engines=num_engines, leader_rank=i * stride, ranks=(i * stride,),
                                devices=()) for i in range(num_engines)]  # fmt: skip
    if placement == "colocated":
        return [
            _colocated(i, num_engines, engine_tp_size, train_world_size, ranks_per_node) for i in range(num_engines)
        ]
    return _separate(num_engines, engine_tp_size, train_world_size, ranks_per_node, pool_gpus)


def _colocated(index: int, num_engines: int, engine_tp: int, world: int, ranks_per_node: int) -> EnginePlacement:
    first = index * (world // num_engines)
    ranks = tuple(range(first, first + engine_tp))
    if first // ranks_per_node != ranks[-1] // ranks_per_node:
        raise ValueError(
            f"rollout.engine_tp_size={engine_tp}: engine {index} would span ranks {list(ranks)} on two nodes of "
            f"{ranks_per_node} ranks; use an engine_tp_size that divides the ranks per node"
        )
    devices = tuple(r % ranks_per_node for r in ranks)
    return EnginePlacement(index=index, num_engines=num_engines, leader_rank=first, ranks=ranks, devices=devices)


def _separate(num_engines: int, engine_tp: int, world: int, ranks_per_node: int, pool: int) -> list[EnginePlacement]:
    num_nodes = max(world // ranks_per_node, 1)
    per_node = num_engines // num_nodes if num_engines % num_nodes == 0 else 0
    if per_node == 0 or per_node > ranks_per_node or (pool // num_nodes) < per_node * engine_tp:
        raise ValueError(
            f"rollout.num_engines={num_engines} separate engines (rollout.engine_tp_size={engine_tp}, "
            f"rollout.num_engine_gpus={pool}) do not spread evenly over {num_nodes} node(s) of {ranks_per_node} "
            "training ranks; give every node the same number of engine GPUs"
        )
    placements = []
    for i in range(num_engines):
        node, slot = divmod(i, per_node)
        leader = node * ranks_per_node + slot
        devices = tuple(ranks_per_node + slot * engine_tp + k for k in range(engine_tp))
        placements.append(
            EnginePlacement(index=i, num_engines=num_engines, leader_rank=leader, ranks=(leader,), devices=devices)
        )
    return placements


def visible_devices(devices: tuple[int, ...], inherited: str | None) -> str:
    """``CUDA_VISIBLE_DEVICES`` of an engine on the node-local ``devices``, read through the node's own list.

    ``inherited``: the rank's ``CUDA_VISIBLE_DEVICES`` (Slurm sets it, e.g. ``"4,5,6,7"`` for half a node): local
    device ``d`` is its ``d``-th entry (an index or a UUID); None or empty: ``d`` itself.

    Raises:
        ValueError: a device past the end of the inherited list (names both and the fix).
    """
    if not inherited:
        return ",".join(str(d) for d in devices)
    visible = [entry.strip() for entry in inherited.split(",")]
    if max(devices) >= len(visible):
        raise ValueError(
            f"an engine needs the node's GPUs {list(devices)}, but CUDA_VISIBLE_DEVICES={inherited} shows "
            f"{len(visible)}; give each node at least {max(devices) + 1} GPUs (sbatch --gpus-per-node) or lower "
            "rollout.num_engine_gpus"
        )
    return ",".join(visible[d] for d in devices)


def relay_workers(
    placements: list[EnginePlacement], *, placement: Placement, engine_tp_size: int, accelerator: bool
) -> tuple[int, int] | None:
    """``(relay, target)`` engine-worker indices for the collective weight sync, or None when none is needed.

    Colocated, worker 0 shares rank 0's GPU (NCCL refuses that), so worker 1 feeds it (``parallel/weight_group.py``).

    Raises:
        ValueError: colocated on a single GPU (no other worker to relay).
    """
    if not accelerator or placement != "colocated":
        return None
    if len(placements) * engine_tp_size < 2:
        raise ValueError(
            "rollout.weight_sync=collective with one colocated engine worker on one GPU: NCCL cannot join rank 0 "
            "and the engine on the same GPU; use rollout.weight_sync=files (or more GPUs)"
        )
    return (1, 0)


@dataclass(frozen=True, slots=True)
class CoreSplit:
    """A CPU node's cores: ``trainers[r]`` of local training rank r, ``engine_workers[e * tp + w]`` of its engines.

    Worker w of the node's e-th engine, tp = ``engine_tp_size``; shared only where the node has fewer cores than
    shares.
    """

    trainers: tuple[tuple[int, ...], ...]
    engine_workers: tuple[tuple[int, ...], ...]
    engine_tp_size: int

    def engine_cores(self, slot: int) -> tuple[int, ...]:
        """Every core of the node's ``slot``-th engine, sorted."""
        tp = self.engine_tp_size
        return tuple(sorted({c for worker in self.engine_workers[slot * tp : (slot + 1) * tp] for c in worker}))

    def engine_binding(self, slot: int) -> str:
        """``VLLM_CPU_OMP_THREADS_BIND`` of the node's ``slot``-th engine: one core list per worker, ``|``-separated."""
        tp = self.engine_tp_size
        return "|".join(",".join(map(str, worker)) for worker in self.engine_workers[slot * tp : (slot + 1) * tp])


def split_cores(cores: list[int], *, num_trainer_ranks: int, num_engines: int, engine_tp_size: int) -> CoreSplit:
    """Split a CPU node's ``cores`` into contiguous shares: the training ranks' first, then each engine worker's.

    ``num_trainer_ranks``: the node's training ranks that get cores of their own (0: they share the engines' cores,
    colocated); shares of ``len(cores) // shares`` cores, the first ``len(cores) % shares`` one more; with fewer
    cores than shares each share is one core, round-robin (shared).
    """
    counts = [num_trainer_ranks, num_engines * engine_tp_size]
    num_shares = sum(counts)
    base, extra = divmod(len(cores), num_shares)
    shares, start = [], 0
    for i in range(num_shares):
        size = max(base + (i < extra), 1)
        shares.append(tuple(cores[(start + k) % len(cores)] for k in range(size)))
        start += size
    return CoreSplit(trainers=tuple(shares[: counts[0]]), engine_workers=tuple(shares[counts[0] :]),
                     engine_tp_size=engine_tp_size)  # fmt: skip
