"""What this machine computes on (a CUDA GPU, the CPU's flags) and the dtype the random models follow from it.

torch runs bfloat16 matmuls natively on a CPU only with AVX512-BF16 or AMX; elsewhere it takes far slower
fallback paths, so a CPU run of a bfloat16 model would time those rather than load against recompute.
``choose_dtype`` is the one place the choice is made (model factory, ``sgl-kvtier launch``, the demo, test
servers, CPU benchmarks). In order: an explicit dtype; ``KVTIER_MODEL_DTYPE``; bfloat16 with a CUDA GPU;
bfloat16 with ``avx512_bf16`` or ``amx_bf16`` in /proc/cpuinfo's flags; float32 otherwise. Standard library
only (the GPU probe is ``nvidia-smi -L``). SGLang's ``--dtype auto`` serves a float32 checkpoint in float16,
so a factory model's server gets its dtype spelled out (``dtype_args``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

AUTO = "auto"
ENV_DTYPE = "KVTIER_MODEL_DTYPE"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")
MARKER_NAME = "kvtier_model_spec.json"  # written by the model factory; records the spec and the dtype


def has_cuda_gpu() -> bool:
    """True when ``nvidia-smi -L`` lists a GPU (the test scripts/setup.sh makes); never imports torch."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return False
    try:
        done = subprocess.run([smi, "-L"], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, timeout=60, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


def cpu_flags(cpuinfo_text: str | None = None) -> frozenset[str]:
    """The CPU's feature flags: the first ``flags`` line of ``cpuinfo_text`` (default /proc/cpuinfo's)."""
    if cpuinfo_text is None:
        try:
            cpuinfo_text = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    for line in cpuinfo_text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def native_dtype(cpuinfo_text: str | None = None) -> str:
    """``bfloat16`` when the CPU has ``avx512_bf16`` or ``amx_bf16`` (native bf16 matmuls), else ``float32``."""
    return "bfloat16" if cpu_flags(cpuinfo_text) & set(NATIVE_BF16_FLAGS) else "float32"


@dataclasses.dataclass(frozen=True)
class DtypeChoice:
    """A dtype and why: ``forced`` (an explicit dtype or ``KVTIER_MODEL_DTYPE``) or chosen by ``choose_dtype``."""

    dtype: str
    forced: bool
    reason: str

    def describe(self) -> str:
        """E.g. ``auto: CPU without avx512_bf16/amx_bf16`` or ``forced: --dtype``: what result files record."""
        return f"{'forced' if self.forced else 'auto'}: {self.reason}"


def _check(dtype: str, where: str) -> str:
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"{where}: unknown dtype {dtype!r}; choose from {AUTO}, {', '.join(sorted(DTYPE_BYTES))}")
    return dtype


def choose_dtype(requested: str | None = AUTO, *, gpu: bool | None = None, cpuinfo_text: str | None = None,
                 env: Mapping[str, str] | None = None, source: str = "--dtype") -> DtypeChoice:
    """The model/KV dtype to use: ``requested`` unless it is ``auto`` (or None), then ``KVTIER_MODEL_DTYPE``
    (from ``env``, default ``os.environ``), then bfloat16 on a CUDA GPU (``gpu``; None: ask ``nvidia-smi``),
    then the CPU's native dtype. ``source`` names where an explicit ``requested`` came from."""
    if requested not in (None, AUTO):
        return DtypeChoice(_check(requested, source), True, source)
    forced = (os.environ if env is None else env).get(ENV_DTYPE, "").strip()
    if forced and forced != AUTO:
        return DtypeChoice(_check(forced, ENV_DTYPE), True, ENV_DTYPE)
    if gpu is None:
        gpu = has_cuda_gpu()
    if gpu:
        return DtypeChoice("bfloat16", False, "CUDA GPU")
    flags = sorted(cpu_flags(cpuinfo_text) & set(NATIVE_BF16_FLAGS))
    if flags:
        return DtypeChoice("bfloat16", False, f"CPU has {'/'.join(flags)}")
    return DtypeChoice("float32", False, f"CPU without {'/'.join(NATIVE_BF16_FLAGS)}")


def resolve_dtype(requested: str | None = AUTO, *, gpu: bool | None = None, cpuinfo_text: str | None = None) -> str:
    """``choose_dtype(requested, ...).dtype``: an explicit dtype as it is, ``auto`` resolved."""
    return choose_dtype(requested, gpu=gpu, cpuinfo_text=cpuinfo_text).dtype


def factory_dtype(model_dir: Path | str) -> str | None:
    """The dtype a factory-made model was written in (its marker's), None for any other directory."""
    try:
        dtype = json.loads((Path(model_dir) / MARKER_NAME).read_text()).get("dtype")
    except (OSError, ValueError, AttributeError):
        return None
    return dtype if isinstance(dtype, str) else None


def has_flag(args: Sequence[str], flag: str) -> bool:
    """Whether ``args`` set ``flag`` (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def dtype_args(model_dir: Path | str, args: Sequence[str] = ()) -> list[str]:
    """``["--dtype", <its dtype>]`` for a factory model whose server ``args`` set no ``--dtype``, else ``[]``.

    Without it SGLang's ``--dtype auto`` would serve a float32 model (and its KV cache) in float16."""
    dtype = factory_dtype(model_dir)
    return ["--dtype", dtype] if dtype is not None and not has_flag(args, "--dtype") else []
