"""fla_jax: chunked linear-attention ops for JAX, with the meaning they have in fla 0.6.0."""

from fla_jax._backends import BackendStatus, BackendUnavailableError, FallbackWarning, backends
from fla_jax._checks import check_cu_seqlens
from fla_jax._explain import Explanation, explain
from fla_jax.ops import chunk_delta_rule, chunk_gated_delta_rule, chunk_gla, chunk_simple_gla
from fla_jax.tilelang_backend import Config as TileLangConfig
from fla_jax.recurrent import (
    fused_recurrent_delta_rule,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_gla,
    fused_recurrent_simple_gla,
)

__all__ = [
    "BackendStatus",
    "BackendUnavailableError",
    "Explanation",
    "FallbackWarning",
    "TileLangConfig",
    "backends",
    "check_cu_seqlens",
    "chunk_delta_rule",
    "chunk_gated_delta_rule",
    "chunk_gla",
    "chunk_simple_gla",
    "explain",
    "fused_recurrent_delta_rule",
    "fused_recurrent_gated_delta_rule",
    "fused_recurrent_gla",
    "fused_recurrent_simple_gla",
]
__version__ = "0.1.0"
