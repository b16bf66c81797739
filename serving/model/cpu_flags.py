"""What the CPU can do for int8: ONNX Runtime's uint8 x int8 kernels sum pairs of products in 16 bits on a CPU
without VNNI (AVX2 only), which large uint8 values can saturate; with VNNI or AMX int8 the dot products are exact.
The built-in model is served in int8 only on such CPUs (cli/default.py), and a server that loads an int8 artifact
with per-row activation scales (export/int8/rowwise.py, whose zero-point columns make large values certain) on a CPU
without them says so once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of CPUs with non-saturating int8 dot products
CPUINFO = Path("/proc/cpuinfo")


def cpu_has_vnni(cpuinfo: Path | None = None) -> bool:
    """Whether the CPU's flags (``cpuinfo``, default Linux's ``CPUINFO``) name VNNI or AMX int8; False where they
    cannot be read."""
    try:
        flags = set((cpuinfo or CPUINFO).read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return False
    return any(f in flags for f in VNNI_FLAGS)


def int8_risk(manifest: dict[str, Any], device: str, cpuinfo: Path | None = None) -> str | None:
    """A warning for an int8 artifact with per-row activation scales run on a CPU without VNNI or AMX int8 (None
    for anything else): its answers may depart from the ones its export checked."""
    activations = str(((manifest.get("int8") or {}).get("quantization") or {}).get("activations", ""))
    if manifest.get("precision") != "int8" or "per row" not in activations or device != "cpu" or cpu_has_vnni(cpuinfo):
        return None
    return (
        f"this CPU has none of {', '.join(VNNI_FLAGS)}: ONNX Runtime's int8 kernels here add pairs of products in "
        "16 bits, which this artifact's per-row int8 activations can saturate, so its answers may depart from those "
        "its export checked on another CPU; serve an fp32 export, or one made with --int8-activations tensor"
    )
