"""``moe.compat``'s CPU stand-ins leave ``torch.cuda`` usable by libraries imported after them: ``torch.cuda.Stream``
is still a class, so an annotation such as ``torch.cuda.Stream | None`` (evaluated by transformers' model loading)
works, and an instance takes a stream's arguments and synchronises at once. Run in a fresh interpreter: the patches
are process-wide."""

from __future__ import annotations

import subprocess
import sys

CHECK = """
import torch
from gtpo_megatron.megatron_adapter.cpu_compat import NullStream, install_cpu_compat
from gtpo_megatron.megatron_adapter.moe.compat import install_moe_compat

assert install_cpu_compat()
install_moe_compat()
assert torch.cuda.Stream is NullStream and isinstance(torch.cuda.Stream, type)
annotation = torch.cuda.Stream | None
stream = torch.cuda.Stream(device="cpu", priority=-1)
assert stream.query() and stream.record_event() is stream
with torch.cuda.stream(stream):
    pass
print("ok", annotation)
"""


def test_cuda_stream_stays_a_class_after_the_moe_patches():
    proc = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("ok")
