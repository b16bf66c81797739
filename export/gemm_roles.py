"""The backbone's GEMMs by role, as int8 quantization (``quantize.py``) names them, those it leaves in fp32 by
default, and int8's other defaults (method, smoothing). A module of its own that imports nothing: the CLI builds its parser (``--int8-fp32``) from these names
without the export extras (torch, onnx) installed."""

# the backbone's quantizable nodes by role, in the order a layer runs them: the fused Attention (its Q/K/V
# projection), the attention output projection, the FFN's first GEMM, the FFN's second (output) GEMM
ROLES = ("attention_qkv", "attention_out", "ffn_in", "ffn_out")
# The FFN's output GEMM reads the GELU's output, whose few large values stretch the one run-time scale of its uint8
# activations over all the rest: on 64 amazon_food dev texts its largest value is 8-10x its 99.9th percentile in
# layers 0-2 (3-6x in layers 3-5), against 2.4-2.9x for the Q/K/V projection's input. On the default model's dev
# splits (benchmarks/int8.py, RESULTS.md) leaving it in fp32 in every layer took amazon_food's label agreement with
# fp32 from 96.2% to 99.2% (whole split: 394 of 397 examples) and the 11 tasks pooled from 97.5% to 98.4%, the only
# variant tried that reached 99% there (the closest, the same in layers 0-2 only, 98.99%: one example less; attention
# fp32 97.5-97.7%; the first, the last or both layers fp32 97.0-98.7%). It leaves 6 of the 24 quantized MatMuls of the 11-task graph in
# fp32, a third of the backbone's GEMM work: it costs speed (measured in benchmarks/latency.py, not here).
DEFAULT_FP32_ROLES = ("ffn_out",)

METHODS = ("dynamic", "static")  # activation scales: per batch at run time, or fixed by calibration (QDQ)
DEFAULT_METHOD = "dynamic"
# SmoothQuant (smooth.py) before quantizing: alpha (None: no smoothing) and the roles smoothed. On the default model's
# target dev splits (694 texts, each role quantized alone, the rest fp32; notes in benchmarks/RESULTS.md, issue 28),
# alpha 0.5 took the FFN's first GEMM from 98.99% / 96.97% label agreement with fp32 (amazon_food / editorial_sentiment)
# to 99.75% / 98.99% and QKV from 98.99% / 98.99% to 99.50% / 97.64%, but the FFN output GEMM from 97.98% / 96.97% down
# to 97.23% / 94.28%: its int8 weights (one scale per output column) pay for the GELU's outlier channel more than the
# activation gains. So the FFN output is not smoothed (and stays fp32 by DEFAULT_FP32_ROLES).
DEFAULT_SMOOTH_ALPHA: float | None = 0.5
DEFAULT_SMOOTH_ROLES = ("attention_qkv", "ffn_in")
