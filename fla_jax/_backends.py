"""Backend registry: which implementations exist, which are usable here, and why not."""

from __future__ import annotations

import dataclasses
import functools
import warnings
from collections.abc import Callable

from fla_jax import reference, tilelang_backend, xla
from fla_jax._problem import Problem

NAMES = ("auto", "reference", "xla", "tilelang")


class BackendUnavailableError(ValueError):
    """The requested backend cannot run this call here; the message says why."""


class FallbackWarning(UserWarning):
    """`backend="auto"` ran a call on XLA on a machine where the TileLang kernels run, because they do
    not take this call (the message says why)."""


@dataclasses.dataclass(frozen=True, slots=True)
class BackendStatus:
    name: str
    usable: bool
    reason: str | None = None

    def __str__(self) -> str:
        return f"{self.name}: " + ("usable" if self.usable else f"not usable ({self.reason})")


@dataclasses.dataclass(frozen=True, slots=True)
class Backend:
    """A resolved backend. `raw` backends take q, k, v as given (not scaled, normalised or
    expanded to the value heads, which they do themselves) and the scale as a keyword."""

    name: str
    run: Callable
    raw: bool = False


_PURE = {"reference": Backend("reference", reference.run), "xla": Backend("xla", xla.run)}
TILELANG = Backend("tilelang", tilelang_backend.run, raw=True)


def tilelang(config: tilelang_backend.Config | None = None) -> Backend:
    """The tilelang backend running calls as `config` says (`fla_jax.TileLangConfig`; the default where None)."""
    return TILELANG if config is None else Backend("tilelang", functools.partial(tilelang_backend.run, config=config), raw=True)


def backends() -> dict[str, BackendStatus]:
    """Says which backends are usable here and, for each one that is not, why."""
    usable, reason = tilelang_backend.status()
    return {
        "reference": BackendStatus("reference", True),
        "xla": BackendStatus("xla", True),
        "tilelang": BackendStatus("tilelang", usable, reason),
    }


def _check_name(name) -> None:
    if isinstance(name, tilelang_backend.Config):
        return
    if not isinstance(name, str) or name not in NAMES:
        raise ValueError(f"`backend` must be one of {NAMES} or a fla_jax.TileLangConfig, got {name!r}")


def resolve(name, problem: Problem, *, K: int, V: int, varlen: bool, grouped: bool, l2norm: bool) -> Backend:
    """The backend `name` for this call ("auto": the fastest usable one that takes it; a `TileLangConfig`:
    the tilelang backend so configured)."""
    _check_name(name)
    config = name if isinstance(name, tilelang_backend.Config) else None
    name = "tilelang" if config is not None else name
    if name in _PURE:
        return _PURE[name]
    usable, reason = tilelang_backend.status()
    if usable:
        reason = tilelang_backend.unsupported(problem, K=K, V=V, varlen=varlen, grouped=grouped, l2norm=l2norm)
    if reason is None:
        return tilelang(config)
    if name == "auto":
        if usable:  # on a Hopper GPU with the kernels built, a call they do not take runs several times slower: say so
            warnings.warn(f"fla_jax: {problem.op} runs on the xla backend, not the TileLang kernels: {reason} "
                          "(fla_jax.explain(op, *args, **kwargs) says what a call runs)", FallbackWarning, stacklevel=2)
        return _PURE["xla"]
    raise BackendUnavailableError(f"backend 'tilelang' cannot run {problem.op}: {reason}")


def resolve_name(name: str, problem: Problem, **call) -> str:
    """The name of the backend that `resolve` picks for this call (for reports such as the demo's)."""
    return resolve(name, problem, **call).name
