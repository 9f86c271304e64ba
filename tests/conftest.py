import jax

# The float64 reference needs x64; the library itself always passes explicit dtypes.
jax.config.update("jax_enable_x64", True)


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU and the built TileLang extension")
