"""TileLang programs for fla_jax's CUDA kernels, and the list of variants built from them."""
