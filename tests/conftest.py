"""Test configuration: 8 fake CPU devices, set before anything imports JAX.

XLA reads the device count once, when the backend starts, so the flag must be in the
environment before the first `import jax` of the test process (pytest imports this
file before any test module).
"""

import os

_FAKE_DEVICES = "--xla_force_host_platform_device_count=8"
if _FAKE_DEVICES not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAKE_DEVICES).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
if os.environ["JAX_PLATFORMS"] != "cpu":
    # The float32 parity tests (tolerances ~1e-5) need full-precision matmuls; GPUs default
    # to TF32 for float32 dots. On CPU float32 dots are already exact.
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
# Tests compare against float64 NumPy references in places; they opt in per test with
# `jax.experimental.enable_x64` rather than globally.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402  (must come after the flags above)
import pytest  # noqa: E402


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices: {jax.device_count()} x {jax.devices()[0].platform}"


@pytest.fixture
def n_devices():
    return jax.device_count()


def require_devices(n: int):
    """Skip (with the reason) when fewer than n devices are visible."""
    return pytest.mark.skipif(
        jax.device_count() < n, reason=f"needs {n} devices, have {jax.device_count()}"
    )
