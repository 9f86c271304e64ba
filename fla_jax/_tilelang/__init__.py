"""The TileLang kernels' glue, one module per op (`simple_gla`, `gla`, `delta`) and what they share
(`common`, `runtime`, `config`); `fla_jax.tilelang_backend` is the backend built on them."""
