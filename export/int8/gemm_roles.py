"""The backbone's GEMMs by role, as int8 quantization (``quantize.py``) names them, and int8's defaults (the roles left
in fp32, method, activation scales, smoothing) with the measurements behind them. A module of its own that imports
nothing: the CLI builds its parser (``--int8-fp32``) from these names without the export extras (torch, onnx)."""

# the backbone's quantizable nodes by role, in the order a layer runs them: the fused Attention (its Q/K/V
# projection), the attention output projection, the FFN's first GEMM, the FFN's second (output) GEMM
ROLES = ("attention_qkv", "attention_out", "ffn_in", "ffn_out")

# Every GEMM int8 (issue 28). Before per-row activation scales, the FFN output GEMM stayed fp32: its input (the GELU's
# output) has a few large values that stretched the one per-tensor scale (every GEMM int8 kept 97.33% / 97.75% of
# fp32's labels on the targets' test splits, FFN output fp32 98.26% / 98.36%). With one scale per row (ACTIVATIONS)
# and QKV smoothed, every GEMM int8 keeps >= 99% on both (benchmarks/RESULTS.md, issue 28's sections).
DEFAULT_FP32_ROLES: tuple[str, ...] = ()

METHODS = ("dynamic", "static")  # activation scales: per batch at run time, or fixed by calibration (QDQ)
DEFAULT_METHOD = "dynamic"

# Activation scales of the dynamic method: "row", one uint8 scale and zero point per row (token) of the input computed
# at run time (rowwise.py), for the backbone GEMMs of ROW_ROLES, or "tensor", one per tensor (ONNX Runtime's
# quantizer) as everywhere else. The fused Attention's QKV projection keeps ONNX Runtime's per-tensor QAttention:
# made per-row (a MatMul, then MultiHeadAttention) it moved the answers more, not less (mean largest probability
# change on the targets' dev texts 1.215 / 1.256 points against 1.135 / 1.217): its input's outliers sit in channels
# of every token, which smoothing takes instead. Measured on the built-in model's targets, dev + train texts (1,694;
# label agreement with fp32 and the mean largest probability change in points, amazon_food / editorial_sentiment),
# every GEMM int8: per tensor 97.88% / 97.24% (1.87 / 1.76); per row, symmetric 99.11% / 99.00% (0.87 / 0.98);
# per row, asymmetric 99.11% / 99.00% (0.69 / 0.80), the form rowwise.py makes.
ACTIVATIONS = ("row", "tensor")
ROW_ROLES = ("attention_out", "ffn_in", "ffn_out")
DEFAULT_ACTIVATIONS = "row"

# SmoothQuant (smooth.py) before quantizing: alpha (None: no smoothing) and the roles smoothed. With per-row
# activations, alpha swept on the targets' dev + train texts (mean largest probability change, points, amazon_food /
# editorial_sentiment) for QKV: none 0.69 / 0.80, 0.3 0.69 / 0.72, 0.5 0.61 / 0.75, 0.65 0.61 / 0.69, 0.8 0.57 / 0.70,
# 0.9 0.57 / 0.73; FFN in at 0.5 0.69 / 0.73, FFN out at 0.5 0.69 / 0.65 (within the noise of one another; each role
# alone, per-row elsewhere; the table is in RESULTS.md). Smoothing QKV at 0.8 is the one clear gain: the per-row
# GEMMs need no Mul in front of them.
DEFAULT_SMOOTH_ALPHA: float | None = 0.8
DEFAULT_SMOOTH_ROLES = ("attention_qkv",)
