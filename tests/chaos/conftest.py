"""Chaos engine tests: the test doubles in ``chaos_doubles`` are in the fault catalogue
(``FLEETWARD_FAULT_MODULES``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
os.environ["FLEETWARD_FAULT_MODULES"] = "chaos_doubles"
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


@pytest.fixture
def doubles_env() -> dict[str, str]:
    """Environment for a subprocess that must know the test doubles."""
    return {**os.environ, "PYTHONSAFEPATH": "1", "FLEETWARD_FAULT_MODULES": "chaos_doubles",
            "PYTHONPATH": os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")]))}
