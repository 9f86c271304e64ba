"""Backend registry: which implementations exist, which are usable here, and why not."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fla_jax import reference, xla
from fla_jax._problem import Problem

NAMES = ("auto", "reference", "xla", "tilelang")


class BackendUnavailableError(ValueError):
    """The requested backend cannot run this call here; the message says why."""


@dataclasses.dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str | None = None

    def __str__(self) -> str:
        return f"{self.name}: " + ("usable" if self.usable else f"not usable ({self.reason})")


def _tilelang_status() -> BackendStatus:
    try:
        from fla_jax import _ext  # noqa: F401  (built by build.py)
    except ImportError as e:
        return BackendStatus("tilelang", False, f"the TileLang CUDA kernels are not built into this install ({e})")
    return BackendStatus("tilelang", False, "the TileLang kernels are not wired to the ops yet")


def backends() -> dict[str, BackendStatus]:
    """Says which backends are usable here and, for each one that is not, why."""
    return {
        "reference": BackendStatus("reference", True),
        "xla": BackendStatus("xla", True),
        "tilelang": _tilelang_status(),
    }


def resolve(name: str, problem: Problem) -> Callable:
    """The run function of backend `name` for `problem` ("auto": the fastest usable one)."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"`backend` must be one of {NAMES}, got {name!r}")
    if name == "auto":
        return xla.run
    status = backends()[name]
    if not status.usable:
        raise BackendUnavailableError(f"backend {name!r} cannot run {problem.op}: {status.reason}")
    return {"reference": reference.run, "xla": xla.run}[name]


def resolve_name(name: str) -> str:
    """The backend "auto" stands for here (other names are returned as they are, if valid)."""
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"`backend` must be one of {NAMES}, got {name!r}")
    return "xla" if name == "auto" else name
