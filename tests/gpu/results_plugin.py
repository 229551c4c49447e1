"""pytest plugin of the GPU check runner (``run_checks.py`` loads it with ``-p tests.gpu.results_plugin``): writes
each check's outcome as soon as it is known (``report.write_result``), so a check that crashes or hangs its process
cannot hide the results of the checks before it."""

from __future__ import annotations

from tests.gpu.report import write_result


def pytest_runtest_logreport(report) -> None:
    write_result(report)
