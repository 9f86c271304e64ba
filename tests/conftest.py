import os

# Eight host devices for the sharding tests; must be set before JAX starts its CPU backend.
if "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

import jax  # noqa: E402

# The float64 reference needs x64; the library itself always passes explicit dtypes.
jax.config.update("jax_enable_x64", True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU and the built TileLang extension")
