"""GPU checks (``@pytest.mark.gpu``, skipped without CUDA); run them all with ``tests/gpu/run_gpu_checks.sh``."""
