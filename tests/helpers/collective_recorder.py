"""A recording stand-in for ``torch.distributed``'s collectives: who issued each call, with tensors on which device.

The package's rule (``gtpo_megatron/parallel/collectives.py``): every collective the package issues
goes through that module, which puts the tensors on the group's device; the weight gather
(``megatron_adapter/hf_stream.py``) is the one other caller, and Megatron's own internals are Megatron's business.

``CollectiveRecorder`` (a context manager) replaces each name of :data:`COLLECTIVES` on the ``torch.distributed``
module by a wrapper that records a :class:`CollectiveCall` and then calls the real function, so the run is unchanged.
Only the public attribute is replaced: torch's own nested calls (``broadcast_object_list`` -> ``broadcast``) are not
recorded twice. :func:`violations` lists the package calls that break the rule.
"""

from __future__ import annotations

import inspect
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from gtpo_megatron.parallel.collectives import group_device

COLLECTIVES = (
    "all_reduce",
    "all_reduce_coalesced",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_coalesced",
    "_all_gather_base",
    "gather",
    "scatter",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "_reduce_scatter_base",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "broadcast_object_list",
    "all_gather_object",
    "gather_object",
    "scatter_object_list",
    "send_object_list",
    "recv_object_list",
)
"""The ``torch.distributed`` functions that communicate (the static scan and the recorder both use this list)."""
_NOT_WRAPPED = ("isend", "irecv")
"""``torch.distributed.P2POp`` accepts only these very function objects as its ``op`` (Megatron's pipeline schedules
build P2POps): the recorder sees them through ``batch_isend_irecv``, the source scan everywhere."""

REPO = Path(__file__).resolve().parents[2]
ALLOWED_CALLERS = ("gtpo_megatron/parallel/collectives.py", "gtpo_megatron/megatron_adapter/hf_stream.py")
"""The package files that may call the collectives: the collectives module and the weight gather."""
_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_PACKAGE_DIR = str(REPO / "gtpo_megatron") + os.sep


@dataclass(frozen=True)
class CollectiveCall:
    """One recorded collective.

    Attributes:
        name: the ``torch.distributed`` function.
        origin: ``"package"`` (a ``gtpo_megatron`` file), ``"megatron"`` or ``"other"`` (tests, torch itself).
        caller: ``path:line`` of the first frame outside torch (repo-relative for package files).
        devices: devices of the tensors the package passed (object collectives, barriers, others' calls: none).
        declared: ``parallel.collectives.group_device`` of the group of the package's tensor collectives, else None.
    """

    name: str
    origin: str
    caller: str
    devices: tuple[str, ...]
    declared: str | None


def _caller(frame) -> tuple[str, str]:
    """``(origin, "path:line")`` of the first frame outside torch, starting at ``frame``."""
    while frame is not None and frame.f_code.co_filename.startswith(_TORCH_DIR):
        frame = frame.f_back
    if frame is None:
        return "other", "?"
    path = frame.f_code.co_filename
    if path.startswith(_PACKAGE_DIR):
        return "package", f"{Path(path).relative_to(REPO).as_posix()}:{frame.f_lineno}"
    origin = "megatron" if f"{os.sep}megatron{os.sep}" in path else "other"
    return origin, f"{path}:{frame.f_lineno}"


def _tensors(bound: inspect.BoundArguments) -> list[torch.Tensor]:
    found = []
    for value in bound.arguments.values():
        items = value if isinstance(value, list | tuple) else [value]
        found += [item for item in items if isinstance(item, torch.Tensor)]
    return found


def _record(name: str, real, args: tuple, kwargs: dict, frame) -> CollectiveCall:
    """The call's origin; for the package's own calls also its tensors' devices and its group's declared device."""
    origin, caller = _caller(frame)
    devices, declared = (), None
    if origin == "package" and "object" not in name and "barrier" not in name:
        bound = inspect.signature(real).bind(*args, **kwargs)
        devices = tuple(str(t.device) for t in _tensors(bound))
        declared = str(group_device(bound.arguments.get("group") or dist.group.WORLD))
    return CollectiveCall(name=name, origin=origin, caller=caller, devices=devices, declared=declared)


class CollectiveRecorder:
    """Records every ``torch.distributed`` collective issued inside the ``with`` block (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[CollectiveCall] = []
        self._saved: dict[str, object] = {}

    def _wrap(self, name: str, real):
        def recorded(*args, **kwargs):
            self.calls.append(_record(name, real, args, kwargs, sys._getframe(1)))
            return real(*args, **kwargs)

        return recorded

    def __enter__(self) -> CollectiveRecorder:
        for name in (n for n in COLLECTIVES if n not in _NOT_WRAPPED):
            self._saved[name] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, self._saved[name]))
        return self

    def __exit__(self, *exc) -> None:
        for name, real in self._saved.items():
            setattr(dist, name, real)
        self._saved.clear()


def violations(calls: list[CollectiveCall]) -> list[str]:
    """The package calls that break the rule, each once: issued outside :data:`ALLOWED_CALLERS`, or with a tensor that
    is not on the group's declared device. Megatron's and other callers' calls are not judged."""
    problems = []
    for call in calls:
        if call.origin != "package":
            continue
        if not call.caller.startswith(ALLOWED_CALLERS):
            problems.append(f"{call.caller}: calls torch.distributed.{call.name} directly; use parallel.collectives")
        wrong = [d for d in call.devices if d != call.declared]
        if wrong:
            problems.append(
                f"{call.caller}: {call.name} with tensors on {wrong}, its group's device is " + call.declared
            )
    return list(dict.fromkeys(problems))
