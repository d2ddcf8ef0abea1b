"""The machine a benchmark ran on, recorded in every result file and printed in every report header.

``machine_info`` gathers: CPU model, cores, memory, torch's CPU capability and the CPU flags that decide
which matmul kernels torch can use, a ~1 s fp32 / bf16 matmul probe (GFLOP/s; smaller matrices where a
dtype is slow), the GPU if any, the dtype this CPU computes natively
(``sgl_kvtier.serving.hardware.native_dtype``: what ``auto`` picks on CPU), and the model dtype the run used
with how it was chosen (given by the caller: ``auto: ...`` or ``forced: ...``).
``machine_line`` is the one-line form for headers.
"""

from __future__ import annotations

import os
import platform
import subprocess
import time
from pathlib import Path
from typing import Any

from sgl_kvtier.serving.hardware import native_dtype

FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
PROBE_N = 2048  # square matmul side of the probe
PROBE_S = 0.4  # seconds of timed matmuls per dtype (at least one matmul)


def cpu_model_and_flags() -> tuple[str, dict[str, bool]]:
    """The CPU's model name and which of ``FLAGS`` it has (from /proc/cpuinfo; all False elsewhere)."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            name, _, value = (part.strip() for part in line.partition(":"))
            if name == "model name" and not model:
                model = value
            elif name == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    model = model or platform.processor() or platform.machine()
    return model, {f: f in flags for f in FLAGS}


def memory_gib() -> float:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)


def memory_available_bytes() -> int | None:
    """The memory that can be allocated now without swapping (psutil's ``available``, what SGLang's host-pool
    check reads too), None where psutil cannot tell."""
    import psutil

    try:
        return int(psutil.virtual_memory().available)
    except (OSError, RuntimeError, AttributeError):
        return None


def matmul_gflops(dtype_name: str, n: int = PROBE_N, budget_s: float = PROBE_S) -> float:
    """GFLOP/s of square matmuls in ``dtype_name`` on the CPU, with torch's default thread count.

    The side starts at 256 and doubles up to ``n`` while one matmul of the next side (8x the work) is
    predicted to fit in ``budget_s``: a dtype this CPU has no kernels for (bf16 without AVX512-BF16 / AMX:
    measured 5-300x slower than fp32) is probed on smaller matrices, never for minutes."""
    import torch

    dtype = getattr(torch, dtype_name)
    side = 256
    while True:
        a, b = torch.randn(side, side).to(dtype), torch.randn(side, side).to(dtype)
        t0 = time.perf_counter()
        a @ b  # the first one also starts the thread pool and loads the kernels
        one_s = time.perf_counter() - t0
        if side * 2 > n or one_s * 8 > budget_s:
            break
        side *= 2
    done, t0 = 0, time.perf_counter()
    while done == 0 or time.perf_counter() - t0 < budget_s:
        a @ b
        done += 1
    return round(2 * side**3 * done / (time.perf_counter() - t0) / 1e9, 1)


def gpus() -> list[dict[str, Any]]:
    """Each CUDA GPU torch sees: name and memory; empty without one."""
    import torch

    if not torch.cuda.is_available():
        return []
    return [{"name": torch.cuda.get_device_name(i),
             "memory_gib": round(torch.cuda.get_device_properties(i).total_memory / 2**30, 1)}
            for i in range(torch.cuda.device_count())]


def filesystem(path: Path) -> dict[str, str]:
    """The filesystem ``path`` is on: its source device and type (from ``df``)."""
    proc = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True)
    fields = (proc.stdout.strip().splitlines()[-1:] or ["? ?"])[0].split() if proc.returncode == 0 else []
    return {"fs_source": fields[0] if fields else "?", "fs_type": fields[1] if len(fields) > 1 else "?"}


def machine_info(model_dtype: str | None, path: Path | None = None, probe: bool = True,
                 dtype_source: str | None = None) -> dict[str, Any]:
    """The machine facts a result records. ``model_dtype``: the dtype of the model (or KV pages) the run used,
    None when it used none, and ``dtype_source`` how it was chosen (``DtypeChoice.describe()``: ``auto: ...`` or
    ``forced: ...``); ``path``: also record the filesystem under test; ``probe``: run the matmul probe."""
    import torch

    model, flags = cpu_model_and_flags()
    info: dict[str, Any] = {
        "host": platform.node(), "cpu_model": model, "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)), "mem_gib": memory_gib(), "kernel": platform.release(),
        "python": platform.python_version(), "torch": torch.__version__,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cpu_flags": flags,
        "torch_threads": torch.get_num_threads(), "gpus": gpus(), "native_dtype": native_dtype(),
        "model_dtype": model_dtype, "model_dtype_source": dtype_source,
        "root": os.geteuid() == 0, "loadavg_1m": os.getloadavg()[0],
    }  # fmt: skip
    if probe:
        info["matmul_gflops"] = {name: matmul_gflops(dtype) for name, dtype in (("fp32", "float32"),
                                                                                ("bf16", "bfloat16"))}
    if path is not None:
        info.update(filesystem(path))
    return info


def machine_line(info: dict[str, Any]) -> str:
    """One line for a report header, e.g. ``Intel Xeon, 2 cores, 7.8 GiB; torch CPU AVX512 ...``."""
    flags = " ".join(f for f, on in info.get("cpu_flags", {}).items() if on) or "none of " + "/".join(FLAGS)
    mm = info.get("matmul_gflops")
    probe = f"; matmul {PROBE_N}^2 fp32 {mm['fp32']:g} / bf16 {mm['bf16']:g} GFLOP/s" if mm else ""
    gpu = ", ".join(g["name"] for g in info.get("gpus", [])) or "none"
    fs = f"; scratch on {info['fs_type']} ({info['fs_source']})" if "fs_type" in info else ""
    source = f" ({info['model_dtype_source']})" if info.get("model_dtype") and info.get("model_dtype_source") else ""
    return (f"{info.get('cpu_model', '?')}, {info.get('cores', '?')} cores ({info.get('cores_usable', '?')} usable), "
            f"{info.get('mem_gib', '?')} GiB; torch CPU capability {info.get('cpu_capability', '?')}; flags {flags}"
            f"{probe}; CPU-native dtype {info.get('native_dtype', '?')}; GPU {gpu}; "
            f"model dtype {info.get('model_dtype') or 'none'}{source}{fs}")
