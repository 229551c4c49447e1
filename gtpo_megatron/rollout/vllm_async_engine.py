"""The partial-rollout engine (``rollout.partial_rollouts``): vLLM's ``AsyncLLM``, updated while its requests run.

``AsyncVLLMEngine`` is ``VLLMEngine`` (the same settings, seeds, staging and ``reload_weights`` walk of
``rollout/vllm_worker.py``) started as an ``AsyncLLM`` whose event loop runs in a daemon thread: ``generate`` submits
each batch's requests to it and returns when they finish; while a batch generates, another thread may call
:meth:`AsyncVLLMEngine.pause` (``pause_generation(mode="keep", clear_cache=False)``), load new weights through any
sync path, and :meth:`AsyncVLLMEngine.resume` (label them ``version``, ``resume_generation``): the order is
``rollout/engine_guard.py:load_in_flight``'s.

Why the KV is kept and each token's recorded version is exact: docs/training.md, "Partial rollouts".
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections.abc import Coroutine
from typing import Any

from gtpo_megatron.rollout.vllm_engine import VLLMEngine

LOOP_START_TIMEOUT_S = 60.0
"""Longest wait for the event loop thread to start."""


class EventLoopThread:
    """An asyncio loop in a daemon thread; :meth:`run` runs a coroutine there and waits for its result."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="gtpo-async-engine", daemon=True)
        self._thread.start()

    def run(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """The coroutine's value (its exception raised here); callable from any thread but the loop's."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def stop(self) -> None:
        """Stop the loop after the callbacks in progress (the thread ends; idempotent)."""
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(LOOP_START_TIMEOUT_S)


class AsyncFacade:
    """What ``VLLMEngine`` calls on ``vllm.LLM``, answered by an ``AsyncLLM`` on ``loop``; plus pause and resume.

    ``llm_engine`` is the ``AsyncLLM`` (its ``model_config`` and ``engine_core`` are ``LLM.llm_engine``'s).
    """

    def __init__(self, llm: Any, loop: EventLoopThread) -> None:
        self.llm_engine, self.loop = llm, loop
        self._request_ids = itertools.count()

    def generate(self, prompts: list, params: list, use_tqdm: bool = False, lora_request: Any = None) -> list:
        """The final ``RequestOutput`` of each (prompt, params) pair, in order, all submitted at once.

        ``lora_request``: ``LLM.generate``'s (None: the base weights), passed to every request.
        """
        from vllm.sampling_params import RequestOutputKind

        async def one(prompt, param) -> Any:
            param.output_kind = RequestOutputKind.FINAL_ONLY
            request_id = f"gtpo-{next(self._request_ids)}"
            stream = self.llm_engine.generate(prompt, param, request_id, lora_request=lora_request)
            outputs = [o async for o in stream]
            return outputs[-1]

        async def every() -> list:
            return list(await asyncio.gather(*(one(p, q) for p, q in zip(prompts, params, strict=True))))

        return self.loop.run(every())

    def collective_rpc(self, method: str, args: tuple = ()) -> list:
        """Call ``method`` on every worker (``WorkerExtension``); their results."""
        return self.loop.run(self.llm_engine.collective_rpc(method, args=args))

    def reset_prefix_cache(self) -> None:
        """Nothing to reset: the engine runs without prefix caching (module docstring)."""

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (its ``decode`` names the text of a stop-string completion)."""
        return self.llm_engine.get_tokenizer()

    def pause(self) -> None:
        """Freeze every request with its KV cache until :meth:`resume`; returns once no step is in progress."""
        self.loop.run(self.llm_engine.pause_generation(mode="keep", clear_cache=False))

    def label(self, version: int) -> None:
        """Stamp the tokens of the next steps with ``version`` (vLLM's weight label)."""
        self.loop.run(self.llm_engine.update_weight_version(str(version)))

    def resume(self) -> None:
        """Schedule the frozen and the queued requests again."""
        self.loop.run(self.llm_engine.resume_generation())


async def _cancelled(task: asyncio.Task) -> None:
    """Cancel ``task`` and wait until it ended."""
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


class AsyncVLLMEngine(VLLMEngine):
    """A ``RolloutEngine`` whose weights can change during ``generate`` (module docstring); ``VLLMEngine``'s args.

    Completions carry ``token_versions``. Routed-experts capture is refused (``rollout.partial_rollouts``'s check).
    """

    def _start(self, llm_class, **kwargs) -> AsyncFacade:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        if kwargs.get("enable_prefix_caching") is not None:
            raise ValueError("partial rollouts run without routed-experts capture (rollout.routing_replay=off)")
        args = AsyncEngineArgs(**kwargs, enable_prefix_caching=False)
        loop = EventLoopThread()

        async def start() -> Any:  # the output handler starts on the running loop
            llm = AsyncLLM.from_engine_args(args)
            await llm.update_weight_version("0")
            return llm

        self._loop = loop
        return AsyncFacade(loop.run(start()), loop)

    @property
    def facade(self) -> AsyncFacade:
        """The ``AsyncFacade`` that ``VLLMEngine``'s code calls as its ``vllm.LLM``."""
        return self._llm

    def pause(self) -> None:
        """Freeze every request with its KV cache (``AsyncFacade.pause``)."""
        self.facade.pause()

    def resume(self, version: int | None) -> None:
        """Label the next tokens ``version`` (None: keep the label, e.g. after a failed load), then resume."""
        if version is not None:
            self.facade.label(version)
        self.facade.resume()

    def close(self) -> None:
        """Shut the engine down, stop its loop, delete the staging folder; idempotent."""
        facade, self._llm = getattr(self, "_llm", None), None
        if facade is not None:
            handler = getattr(facade.llm_engine, "output_handler", None)
            if handler is not None:  # first: vLLM's shutdown stops the core while it reads, and it logs a death
                facade.loop.run(_cancelled(handler))
            facade.llm_engine.shutdown()
        loop = getattr(self, "_loop", None)
        if loop is not None:
            loop.stop()
        if facade is not None:  # collected now: its __del__ shuts down again, which fails at interpreter exit
            facade.llm_engine = None
        self._remove_staging()
