"""Node-local folders (``node_local``): unix sockets that fit ``AF_UNIX`` under a long ``TMPDIR``, weight staging.

A Slurm job's ``TMPDIR`` (node-local scratch) can be long enough that vLLM's IPC sockets (``TMPDIR/<uuid4>``) and
Python's manager sockets (``TMPDIR/pymp-*/listener-*``) exceed the 107 bytes of a socket path, and the engine or
the checkpoint writer's queue would not start.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from gtpo_megatron import node_local
from gtpo_megatron.node_local import MAX_SOCKET_PATH, SHORT_FOLDERS, socket_dir, socket_path, staging_root

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def long_tmpdir(tmp_path) -> Path:
    """A writable folder whose ``<folder>/<uuid4>`` is longer than a socket path may be."""
    folder = tmp_path / ("slurm-job-scratch-" + "x" * 70)
    folder.mkdir()
    assert len(str(folder)) + 37 > MAX_SOCKET_PATH
    return folder


def _bind(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.bind(path)
    os.unlink(path)


def test_a_short_temporary_folder_is_kept(monkeypatch):
    short = tempfile.mkdtemp(prefix="gtpo-", dir="/tmp")
    monkeypatch.setattr(tempfile, "tempdir", short)
    assert socket_dir() == short
    os.rmdir(short)


def test_a_long_temporary_folder_falls_back_to_a_short_one_where_sockets_bind(long_tmpdir, monkeypatch):
    with pytest.raises(OSError, match="too long"):
        _bind(f"{long_tmpdir}/{'f' * 36}")  # where vLLM's default IPC path would put a socket
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmpdir))
    assert socket_dir() in SHORT_FOLDERS
    path = socket_path("gtpo-test")
    assert Path(path).parent == Path(socket_dir()) and not os.path.exists(path)
    _bind(path)


def test_no_short_writable_folder_is_refused_naming_tmpdir(long_tmpdir, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(long_tmpdir))
    with pytest.raises(RuntimeError, match=r"TMPDIR='.*x' is longer than 59 bytes.*set TMPDIR to a shorter"):
        socket_dir((str(long_tmpdir), str(tmp_path / "missing")))


def test_the_checkpoint_writers_queue_starts_under_a_long_tmpdir(long_tmpdir):
    """The forked queue manager of ``megatron_adapter.checkpoint`` (Python's default socket path: too long)."""
    code = (
        "from megatron.core.dist_checkpointing.strategies import filesystem_async as fa\n"
        "from gtpo_megatron.megatron_adapter.checkpoint import _sigterm_proof_write_queue\n"
        "fa._results_queue = None\n"
        "_sigterm_proof_write_queue()\n"
        "fa._results_queue.put('written'); print(fa._results_queue.get())\n"
    )
    env = {**os.environ, "TMPDIR": str(long_tmpdir), "PYTHONPATH": str(REPO), "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("written")


def test_vllm_engines_get_a_short_ipc_folder(long_tmpdir, monkeypatch):
    pytest.importorskip("vllm")
    from gtpo_megatron.rollout.vllm_start import engine_environment

    monkeypatch.setattr(tempfile, "tempdir", str(long_tmpdir))
    monkeypatch.delenv("VLLM_RPC_BASE_PATH", raising=False)
    with engine_environment(cpu_kvcache_space_gib=1, in_process=None, model_path="x", extra={}, quiet_logs=None):
        import vllm.envs

        assert vllm.envs.VLLM_RPC_BASE_PATH in SHORT_FOLDERS
    assert "VLLM_RPC_BASE_PATH" not in os.environ  # restored
    monkeypatch.setenv("VLLM_RPC_BASE_PATH", "/my/own")  # a user's choice is kept
    with engine_environment(cpu_kvcache_space_gib=1, in_process=None, model_path="x", extra={}, quiet_logs=None):
        assert os.environ["VLLM_RPC_BASE_PATH"] == "/my/own"


def test_staging_root_is_the_nodes_choice_else_dev_shm(monkeypatch, tmp_path):
    monkeypatch.setenv("GTPO_STAGING_DIR", str(tmp_path / "node0" / "shm"))
    assert staging_root() == str(tmp_path / "node0" / "shm") and (tmp_path / "node0" / "shm").is_dir()
    monkeypatch.delenv("GTPO_STAGING_DIR")
    monkeypatch.setattr(node_local, "_writable", lambda folder: folder == "/dev/shm")
    assert staging_root() == "/dev/shm"
    monkeypatch.setattr(node_local, "_writable", lambda folder: False)
    assert staging_root() is None
