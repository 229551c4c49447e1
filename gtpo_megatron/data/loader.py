"""A resumable, deterministic prompt iterator.

Epoch ``e`` visits the problems in the order of a permutation drawn from ``random.Random(f"{seed}/{e}")``
(identity order when ``shuffle=False``), so the order depends only on ``(seed, epoch, len(problems))``: every
data-parallel rank that builds the loader the same way sees the same batches, and a run resumed from
:meth:`PromptLoader.state_dict` continues exactly where the saved one stopped. A batch that reaches the end of an
epoch is completed from the start of the next one; epochs never end (the trainer decides when to stop from its
step count or from :attr:`PromptLoader.epoch`).

:meth:`PromptLoader.next_batch` takes an optional size, so DAPO dynamic sampling can draw extra prompts when it
drops groups whose rewards are all equal; those draws are part of the saved position too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from typing import Any

from gtpo_megatron.data.types import Problem


class PromptLoader:
    """Endless batches of problems in a seeded order, with ``state_dict``/``load_state_dict``.

    Args:
        problems: the problem set (not copied; must not change while the loader is used).
        batch_size: default number of problems per :meth:`next_batch` / iteration step (>= 1).
        seed: shuffling seed.
        shuffle: draw a new permutation per epoch (``False``: file order every epoch).

    Raises:
        ValueError: if ``problems`` is empty or ``batch_size < 1``.
    """

    def __init__(self, problems: Sequence[Problem], *, batch_size: int, seed: int = 0, shuffle: bool = True) -> None:
        if not problems:
            raise ValueError("problems is empty; load at least one problem (check data.source / data.limit)")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self._problems = problems
        self.batch_size = batch_size
        self._seed = seed
        self._shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    @property
    def epoch(self) -> int:
        """Index of the epoch the next problem comes from (0-based)."""
        return self._epoch

    @property
    def num_consumed(self) -> int:
        """Problems handed out so far, over all epochs."""
        return self._epoch * len(self._problems) + self._position

    def _epoch_order(self, epoch: int) -> list[int]:
        """Problem indices in the visiting order of ``epoch``."""
        order = list(range(len(self._problems)))
        if self._shuffle:
            random.Random(f"{self._seed}/{epoch}").shuffle(order)
        return order

    def next_batch(self, size: int | None = None) -> list[Problem]:
        """The next ``size`` (default ``batch_size``) problems, continuing into the next epoch when needed.

        Raises:
            ValueError: if ``size < 1``.
        """
        size = self.batch_size if size is None else size
        if size < 1:
            raise ValueError(f"size={size} must be >= 1")
        batch: list[Problem] = []
        while len(batch) < size:
            batch.append(self._problems[self._order[self._position]])
            self._position += 1
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
        return batch

    def fork(self) -> PromptLoader:
        """A loader over the same problems at this one's position, advancing on its own (a look-ahead)."""
        ahead = PromptLoader(self._problems, batch_size=self.batch_size, seed=self._seed, shuffle=self._shuffle)
        ahead.load_state_dict(self.state_dict())
        return ahead

    def __iter__(self) -> Iterator[list[Problem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable position: ``{"epoch", "position", "seed", "shuffle", "num_problems"}``."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self._seed,
            "shuffle": self._shuffle,
            "num_problems": len(self._problems),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores a position saved by :meth:`state_dict`.

        Raises:
            ValueError: if the saved seed, shuffle flag or problem count differ from this loader's (the resumed
                run would see another order), or the position is out of range.
        """
        expected = {"seed": self._seed, "shuffle": self._shuffle, "num_problems": len(self._problems)}
        mismatched = {k: (state.get(k), v) for k, v in expected.items() if state.get(k) != v}
        if mismatched:
            raise ValueError(
                f"loader state does not fit this data (saved, current): {mismatched}; resume with the same "
                "data source, limit and seed as the saved run"
            )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._problems):
            raise ValueError(f"loader state epoch={epoch}, position={position} out of range")
        self._epoch, self._position = epoch, position
        self._order = self._epoch_order(epoch)
