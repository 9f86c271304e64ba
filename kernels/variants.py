"""The variant table, as the build reads it: it lives in the runtime package (`fla_jax/_variants.py`), which
needs it to dispatch and ships without this build-time package."""

from fla_jax._variants import (  # noqa: F401
    DTYPES,
    EXPERIMENTS,
    HEAD_DIMS,
    PROGRAMS,
    VARIANTS,
    Program,
    Variant,
    find,
)
