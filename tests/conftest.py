"""Shared test settings: no Hypothesis deadlines (numba compiles on first call, CI is shared)."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

import faultfs

settings.register_profile("default", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("ci", deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
settings.load_profile("ci" if os.environ.get("CI") else "default")


tiny_tmpfs = pytest.fixture(faultfs.tiny_tmpfs_fixture, name="tiny_tmpfs")
failing_ext4 = pytest.fixture(faultfs.failing_ext4_fixture, name="failing_ext4")
