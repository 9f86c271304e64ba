"""The correctness grid the CPU suite runs for every backend."""

from cases import Case

CASES = [
    # simple GLA
    Case("simple_gla", 2, 1, 2, 64, 64, h0=True),
    Case("simple_gla", 2, 63, 2, 100, 64, dtype="bfloat16"),
    Case("simple_gla", 2, 64, 2, 64, 128, dtype="float16", h0=True),
    Case("simple_gla", 1, 65, 1, 128, 100, gate="g_gamma", h0=True),
    Case("simple_gla", 1, 1000, 2, 64, 64, dtype="bfloat16", norm=0.1, h0=True),
    Case("simple_gla", 2, 130, 1, 256, 256, norm=10.0),
    Case("simple_gla", 1, 300, 2, 64, 32, cu=(0, 0, 37, 37, 200, 300), h0=True),
    Case("simple_gla", 1, 90, 2, 32, 32, gate="none", scale=0.3),
    Case("simple_gla", 2, 100, 2, 32, 32, chunk_size=16, h0=True),
    Case("simple_gla", 2, 200, 2, 32, 32, chunk_size=128, norm=0.1),
    # GLA
    Case("gla", 2, 1, 2, 64, 64, h0=True),
    Case("gla", 2, 63, 2, 100, 64, dtype="bfloat16"),
    Case("gla", 1, 65, 2, 128, 64, dtype="float16", h0=True, norm=10.0),
    Case("gla", 1, 1000, 1, 64, 64, norm=0.1, h0=True),
    Case("gla", 1, 200, 1, 256, 128, norm=0.1),
    Case("gla", 1, 300, 2, 32, 64, cu=(0, 0, 37, 37, 200, 300), h0=True),
    Case("gla", 1, 130, 1, 320, 64),
    # delta rule
    Case("delta_rule", 2, 1, 2, 64, 64, h0=True),
    Case("delta_rule", 2, 63, 2, 100, 64, dtype="bfloat16", l2norm=True),
    Case("delta_rule", 1, 65, 2, 128, 128, dtype="float16", h0=True),
    Case("delta_rule", 1, 1000, 1, 64, 64, h0=True, l2norm=True),
    Case("delta_rule", 1, 130, 1, 256, 256),
    Case("delta_rule", 1, 300, 2, 32, 64, cu=(0, 0, 37, 37, 200, 300), h0=True),
    # gated delta rule (GDN)
    Case("gated_delta_rule", 2, 1, 2, 64, 64, h0=True),
    Case("gated_delta_rule", 2, 63, 2, 100, 64, dtype="bfloat16", HV=4, l2norm=True),
    Case("gated_delta_rule", 1, 65, 2, 128, 128, dtype="float16", h0=True, norm=0.1),
    Case("gated_delta_rule", 1, 1000, 2, 64, 64, HV=4, h0=True, l2norm=True, norm=10.0),
    Case("gated_delta_rule", 1, 130, 1, 256, 256, norm=0.1),
    Case("gated_delta_rule", 1, 300, 1, 32, 64, HV=2, cu=(0, 0, 37, 37, 200, 300), h0=True),
    Case("gated_delta_rule", 2, 64, 2, 64, 64, h0=True, scale=0.5),
]
