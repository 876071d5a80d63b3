"""pytest hooks for tests/ and benches/: `--quick` (the everyday run) and the `gpu` marker, which
skips a test cleanly on a machine without CUDA (CI, the dev box)."""

import pytest
import torch


def pytest_addoption(parser):
    parser.addoption(
        "--quick", action="store_true", default=False,
        help="the everyday run: skip tests marked slow (the CPU soak, long CPU loops), run each "
             "pytest-benchmark test once, untimed (--benchmark-disable), and use one torch "
             "thread. Plain `pytest -q` (CI, .ci/run) runs everything.")


def pytest_configure(config):
    if config.getoption("--quick"):
        # pytest-benchmark reads this in its own (trylast) pytest_configure: the benchmarked
        # function then runs once and the test's assertions still run.
        config.option.benchmark_disable = True
        # The CPU tests run many tiny torch ops. With torch's default of one thread per core and
        # another process busy on one of the 2 cores, every op waits for a descheduled thread:
        # the 6 device-planning reference tests took 194 s that way and 6 s on one thread.
        torch.set_num_threads(1)


def pytest_collection_modifyitems(config, items):
    if config.getoption("--quick"):
        skip_slow = pytest.mark.skip(reason="slow: skipped by --quick (plain pytest runs it)")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (gpu marker); run on the H200")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
