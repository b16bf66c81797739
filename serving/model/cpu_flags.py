"""What the CPU can do for int8 and bf16. int8: ONNX Runtime's uint8 x int8 kernels sum pairs of products in 16 bits on a CPU
without VNNI (AVX2 only), which large uint8 values can saturate; with VNNI or AMX int8 the dot products are exact.
The built-in model is served in int8 only on such CPUs (cli/default.py), and a server that loads an int8 artifact
with per-row activation scales (export/int8/rowwise.py, whose zero-point columns make large values certain) on a CPU
without them says so once. bf16: a CPU with bf16 units (AMX, AVX-512 BF16) runs a bf16 artifact's matrix products on
them (serving/model/openvino_runtime.py); one without them emulates bf16 (AVX-512) at a measured cost, and a process that
loads a bf16 artifact there says so once, with that cost."""

from __future__ import annotations

from pathlib import Path
from typing import Any

VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")  # /proc/cpuinfo flags of CPUs with non-saturating int8 dot products
BF16_FLAGS = ("amx_bf16", "avx512_bf16")  # /proc/cpuinfo flags of CPUs with bf16 matrix units
AMX_BF16 = "amx_bf16"  # the units the built-in model's bf16 speed was measured on (cli/default.py)
CPUINFO = Path("/proc/cpuinfo")
# A bf16 artifact on a CPU without bf16 units, OpenVINO emulating bf16, against the same model's fp32 artifact on ONNX
# Runtime: the batch-16 x 128-token time ratio of benchmarks/precisions.py on an Intel Xeon with AVX-512 and without
# them (MiniLM N = 8: 17.3x; 15.5x at 1 x 128, 11.8x at 1 x 32; RESULTS.md, "Precisions per runtime"); the warning
# below quotes it.
BF16_EMULATED_SLOWDOWN = 17


def cpu_flags(cpuinfo: Path | None = None) -> set[str]:
    """The CPU's flags as ``cpuinfo`` (default Linux's ``CPUINFO``) lists them; empty where it cannot be read."""
    try:
        return set((cpuinfo or CPUINFO).read_text(encoding="utf-8", errors="replace").split())
    except OSError:
        return set()


def cpu_has_vnni(cpuinfo: Path | None = None) -> bool:
    """Whether the CPU's flags (``cpuinfo``, default Linux's ``CPUINFO``) name VNNI or AMX int8; False where they
    cannot be read."""
    return bool(cpu_flags(cpuinfo) & set(VNNI_FLAGS))


def cpu_bf16_units(cpuinfo: Path | None = None) -> list[str]:
    """The bf16 flags of BF16_FLAGS the CPU has (``cpuinfo`` as for ``cpu_flags``); [] without bf16 units."""
    flags = cpu_flags(cpuinfo)
    return [f for f in BF16_FLAGS if f in flags]


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


def cpu_risk(manifest: dict[str, Any], device: str, inference_precision: str, cpuinfo: Path | None = None) -> str | None:
    """``int8_risk`` or ``bf16_risk``: what this CPU means for an artifact's answers or speed, or None."""
    return int8_risk(manifest, device, cpuinfo) or bf16_risk(manifest, inference_precision, cpuinfo)


def bf16_risk(manifest: dict[str, Any], inference_precision: str, cpuinfo: Path | None = None) -> str | None:
    """A warning for a bf16 artifact on a CPU without bf16 units (None for anything else): it runs, with the answers
    its export gated, but slower than the fp32 artifact would. ``inference_precision``: what OpenVINO compiled it in
    ('bf16' emulated on AVX-512, or 'f32' where it cannot even emulate bf16)."""
    if manifest.get("precision") != "bf16" or cpu_bf16_units(cpuinfo):
        return None
    how = (
        f"OpenVINO emulates bf16 here, about {BF16_EMULATED_SLOWDOWN:g}x the time of an fp32 export on ONNX Runtime"
        if inference_precision == "bf16"
        else "OpenVINO runs it in fp32 here (no AVX-512 to emulate bf16 with): fp32's answers at OpenVINO's fp32 speed"
    )
    return (
        f"this CPU has no bf16 units (none of {', '.join(BF16_FLAGS)}): {how} (docs/guides/int8.md); "
        "export fp32, or int8 where the CPU has VNNI, for this CPU"
    )
