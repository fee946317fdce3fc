"""Session-wide warm rank pools and hypothesis profiles.

Each world size gets one RankPool for the whole session (ranks start once: seconds; an example then
costs milliseconds). Pick the hypothesis profile with MINISHARD_HYPOTHESIS_PROFILE=ci|thorough|dev
(default: ci, derandomized so CI is reproducible).
"""
import os

import pytest
from hypothesis import HealthCheck, settings

from minishard.testing import RankPool

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                     HealthCheck.function_scoped_fixture])
settings.register_profile("ci", max_examples=25, derandomize=True, print_blob=True, **_common)
settings.register_profile("dev", max_examples=10, **_common)
settings.register_profile("thorough", max_examples=200, **_common)
settings.load_profile(os.environ.get("MINISHARD_HYPOTHESIS_PROFILE", "ci"))

_pools: dict[int, RankPool] = {}


@pytest.fixture(scope="session")
def pools():
    """``pools(ws)`` -> a warm RankPool of that world size, started on first use."""
    def get(world_size: int) -> RankPool:
        if world_size not in _pools:
            _pools[world_size] = RankPool(world_size, timeout=120).start()
        return _pools[world_size]
    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()
