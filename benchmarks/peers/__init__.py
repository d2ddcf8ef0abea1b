"""The systems ``bench_peers`` runs, one module each, in the order they run (``SYSTEMS``).

``builtin``: recompute, radix, SGLang's ``file`` L3 and sgl-kvtier (no package beyond the project's venv);
``mooncake`` (DRAM pool; SSD offload), ``nixl``, ``lmcache``, ``aibrix`` and ``seaweedfs``: the peers, whose pinned
packages (``constraints.txt``) go into the overlay venv of ``venv``. ``system`` is what each one is;
``cgroup`` the memory cgroup each runs in; ``report`` the table and the PNG.
"""

from __future__ import annotations

from benchmarks.peers.aibrix import Aibrix
from benchmarks.peers.builtin import FileL3, KVTier, Radix, Recompute
from benchmarks.peers.lmcache import LMCache
from benchmarks.peers.mooncake import MooncakeDram, MooncakeSsd
from benchmarks.peers.nixl import Nixl
from benchmarks.peers.seaweedfs import SeaweedFS
from benchmarks.peers.system import System
from benchmarks.serving import configs

SYSTEMS: dict[str, System] = {s.name: s for s in (
    Recompute(), Radix(), FileL3(), KVTier(), MooncakeDram(), MooncakeSsd(), Nixl(), LMCache(), Aibrix(), SeaweedFS(),
)}  # fmt: skip
ALIASES = {"file-l3": "file", "kvtier-l3": "kvtier", "mooncake": "mooncake-dram", "sgl-kvtier": "kvtier"}


def resolve(names: list[str]) -> list[System]:
    """Systems by name (comma or space separated, aliases allowed), in ``SYSTEMS`` order, each once."""
    return configs.pick(names, SYSTEMS, ALIASES, "system")
