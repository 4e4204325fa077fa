"""fleetward's pytest plugin (entry point ``pytest11``): thin and lazy.

It imports nothing heavy at load time; fixtures for fleets, the fault proxy, the fake GPU source and
etcd arrive with the chaos module.
"""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "fleetward_chaos: a fleetward chaos scenario")
