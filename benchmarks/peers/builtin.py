"""The systems that need no package beyond the project's venv, with bench_serving's flags
(``benchmarks.serving.configs``): recompute, radix, SGLang's built-in ``file`` L3 and sgl-kvtier.

Peers that plug into HiCache start from ``hicache_args``: bench_serving's HiCache flags (device pool, host pool,
``--hicache-io-backend direct --hicache-mem-layout layer_first`` on CPU) with the L3 flags left to them.
"""

from __future__ import annotations

import dataclasses

from benchmarks.peers.system import FLASH, NONE, Context, System
from benchmarks.serving import configs


def hicache_args(ctx: Context) -> list[str]:
    """The flags every HiCache system shares (bench_serving's ``hicache-dram``: no L3 yet)."""
    return configs.CONFIGS["c"].args(ctx.plan)


def radix_args(ctx: Context) -> list[str]:
    """The flags of a radix cache without HiCache (bench_serving's ``radix``)."""
    return configs.CONFIGS["b"].args(ctx.plan)


class Builtin(System):
    """A bench_serving configuration (``key``) as it is; its L3 (if any) goes to ``ctx.work``."""

    key = ""

    def server_args(self, ctx: Context) -> list[str]:
        cfg = dataclasses.replace(configs.CONFIGS[self.key], name=self.name)
        plan = dataclasses.replace(ctx.plan, l3_root=ctx.work.parent)  # Config.l3_dir: l3_root / name = ctx.work
        return cfg.args(plan)


class Recompute(Builtin):
    name, key, storage, hicache, l3, flush = "recompute", "a", NONE, False, False, False
    summary = "--disable-radix-cache: every prompt token computed"


class Radix(Builtin):
    name, key, storage, hicache, l3 = "radix", "b", NONE, False, False
    summary = "SGLang's radix cache, device pool only"


class FileL3(Builtin):
    name, key, storage = "file", "d", FLASH
    summary = "HiCache + SGLang's built-in `file` L3 (one file per page, buffered IO)"
    upstream = "https://docs.sglang.ai/advanced_features/hicache_design.html"


class KVTier(Builtin):
    name, key, storage = "kvtier", "e", FLASH
    summary = "HiCache + sgl-kvtier (dynamic backend KVTierStorage, O_DIRECT)"

    def versions(self, ctx: Context) -> dict[str, str]:
        import sgl_kvtier

        return super().versions(ctx) | {"sgl-kvtier": sgl_kvtier.__version__}
