"""The backbone's GEMMs by role, as int8 quantization (``quantize.py``) names them, and int8's defaults (the roles left
in fp32, method, activation scales, smoothing) with the reasons for them; the measurements behind them are in
benchmarks/RESULTS.md, section "int8 in every GEMM: smoothing and static QDQ (issue 28)". A module of its own that
imports nothing: the CLI builds its parser (``--int8-fp32``) from these names without the export extras (torch,
onnx)."""

# the backbone's quantizable nodes by role, in the order a layer runs them: the fused Attention (its Q/K/V
# projection), the attention output projection, the FFN's first GEMM, the FFN's second (output) GEMM
ROLES = ("attention_qkv", "attention_out", "ffn_in", "ffn_out")

# Every GEMM int8 (issue 28). Before per-row activation scales, the FFN output GEMM stayed fp32: its input (the GELU's
# output) has a few large values that stretched the one per-tensor scale. With one scale per row (ACTIVATIONS) and QKV
# smoothed, every GEMM int8 keeps >= 99% of fp32's labels on both targets' test splits (RESULTS.md, the section named
# above).
DEFAULT_FP32_ROLES: tuple[str, ...] = ()

METHODS = ("dynamic", "static")  # activation scales: per batch at run time, or fixed by calibration (QDQ)
DEFAULT_METHOD = "dynamic"

# Activation scales of the dynamic method: "row", one uint8 scale and zero point per row (token) of the input computed
# at run time (rowwise.py), for the backbone GEMMs of ROW_ROLES, or "tensor", one per tensor (ONNX Runtime's
# quantizer) as everywhere else. The fused Attention's QKV projection keeps ONNX Runtime's per-tensor QAttention:
# made per-row (a MatMul, then MultiHeadAttention) it moved the answers more, not less (the section named above): its
# input's outliers sit in channels of every token, which smoothing takes instead. Per row and asymmetric (the form
# rowwise.py makes) moved them least of per tensor, per row symmetric and per row asymmetric, on the built-in model's
# targets' dev + train texts (RESULTS.md, the section named above: "Selection on dev + train texts").
ACTIVATIONS = ("row", "tensor")
ROW_ROLES = ("attention_out", "ffn_in", "ffn_out")
DEFAULT_ACTIVATIONS = "row"
# The adapter path's constant-weight MatMuls (in a multi-task graph the adapters' stacked down-projection; in a one-task
# graph the folded fusion matrices too) take one scale per row as well (issue 38). With one per tensor they were, with
# QKV, what made a row's answer depend on the rows batched with it: through `fusionserve predict`, the built-in model's
# int8 agreed with fp32 on 98.50% of amazon_food's own 1,000-text test split; per row, 99.00% (99.04% on the
# 4,075-text split, unchanged). Leaving them in fp32 instead gave 98.90% (RESULTS.md, "int8 as a user meets it").
DEFAULT_ADAPTER_ROWS = True

# SmoothQuant (smooth.py) before quantizing: alpha (None: no smoothing) and the roles smoothed. With per-row
# activations, alpha was swept for each role alone on the targets' dev + train texts (RESULTS.md, the same selection
# table): smoothing QKV at 0.8 is the one clear gain, the other roles' alphas are within the noise of one another; and
# the per-row GEMMs need no Mul in front of them.
DEFAULT_SMOOTH_ALPHA: float | None = 0.8
DEFAULT_SMOOTH_ROLES = ("attention_qkv",)
