import os
import sys
from pathlib import Path

# The build-time package `kernels/` (TileLang programs) is imported from the checkout: it is no installed package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Eight host devices for the sharding tests; must be set before JAX starts its CPU backend.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
# Rounding where the code rounds: XLA may otherwise keep an intermediate in float32 where a program
# casts it to bf16 ("excess precision"), and whether it does depends on fusion, so the same emulated
# kernels gave results one bf16 rounding apart sharded and unsharded (tests/test_tilelang_glue.py).
if "--xla_allow_excess_precision" not in os.environ["XLA_FLAGS"]:
    os.environ["XLA_FLAGS"] += " --xla_allow_excess_precision=false"

import jax  # noqa: E402

# The float64 reference needs x64; the library itself always passes explicit dtypes.
jax.config.update("jax_enable_x64", True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU and the built TileLang extension")
