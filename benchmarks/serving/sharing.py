"""bench_sharing's four configurations of two SGLang instances, their exact flags, and who served what.

Every configuration runs two instances of one model with the same pools; what differs is where their L3
lives (bench_serving's flags, ``benchmarks.serving.configs``, for each instance):

- ``radix``: SGLang's radix cache alone (bench_serving's ``radix``), no HiCache, no L3;
- ``kvtier-per-instance``: HiCache + a kvtier store per instance (two ``devices`` directories);
- ``file-shared``: HiCache + SGLang's ``file`` backend, both instances on ONE ``file_storage_path``;
- ``kvtier-shared``: HiCache + ONE kvtier store (one ``devices`` directory, ``sharing: host``): each
  instance writes its own writer directory and reads every writer's pages;
- ``kvtier-cluster`` (not run by default): the same store in ``sharing: cluster``, each instance as a host
  of its own (``host_id`` h0 / h1; ``allow_local_fs``: one machine stands for two): other-host liveness by
  lease counters, and each instance sees the other's pages only once its lease announced them (up to
  ``heartbeat_s`` later): what cluster mode costs against ``kvtier-shared``.

Each instance also logs its requests (``--log-requests --log-requests-level 0 --log-requests-format json``
into its own directory): the request ids there say which instance served each request.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

from benchmarks.serving import configs
from benchmarks.serving.workloads import Request, Workload


@dataclasses.dataclass(frozen=True)
class SharingConfig:
    name: str
    summary: str
    base: str  # bench_serving's configuration key: b (radix), d (file-l3), e (kvtier-l3)
    shared: bool = False  # both instances on one L3 directory
    cluster: bool = False  # kvtier in sharing = "cluster", each instance a host of its own

    @property
    def l3(self) -> str | None:
        return configs.CONFIGS[self.base].l3

    def plan_for(self, plan: configs.ServerPlan, instance: int) -> configs.ServerPlan:
        """Instance ``instance``'s plan: its L3 under ``<l3_root>/<name>`` (shared) or ``<name>/w<i>``."""
        root = plan.l3_root / self.name if self.shared else plan.l3_root / self.name / f"w{instance}"
        mode: dict[str, Any] = {}
        if self.shared and self.l3 == "kvtier":
            mode = {"sharing": "cluster", "allow_local_fs": True, "host_id": f"h{instance}"} if self.cluster \
                else {"sharing": "host"}
        extra = {**plan.kvtier_extra, **mode}
        return dataclasses.replace(plan, l3_root=root, kvtier_extra=extra)

    def l3_dir(self, plan: configs.ServerPlan, instance: int) -> Path | None:
        """The directory instance ``instance`` stores its L3 pages in (None without L3)."""
        return configs.CONFIGS[self.base].l3_dir(self.plan_for(plan, instance)) if self.l3 else None

    def l3_dirs(self, plan: configs.ServerPlan, instances: int = 2) -> list[Path]:
        """The distinct L3 directories of the configuration: one when shared, one per instance otherwise."""
        out: list[Path] = []
        for i in range(instances):
            d = self.l3_dir(plan, i)
            if d is not None and d not in out:
                out.append(d)
        return out

    def args(self, plan: configs.ServerPlan, instance: int, request_log: Path | None = None) -> list[str]:
        """SGLang flags of instance ``instance`` (after the model path), with its request log if given."""
        args = configs.CONFIGS[self.base].args(self.plan_for(plan, instance))
        if request_log is not None:
            args += request_log_args(request_log)
        return args


CONFIGS: dict[str, SharingConfig] = {c.name: c for c in (
    SharingConfig("radix", "radix cache only, device pool of each instance, no L3", "b"),
    SharingConfig("kvtier-per-instance", "HiCache + a kvtier store per instance (two directories)", "e"),
    SharingConfig("file-shared", "HiCache + SGLang's `file` L3, both instances on one directory", "d", shared=True),
    SharingConfig("kvtier-shared", "HiCache + one kvtier store shared by both instances (sharing=host)", "e",
                  shared=True),
    SharingConfig("kvtier-cluster", "as kvtier-shared in sharing=cluster, each instance a host of its own", "e",
                  shared=True, cluster=True),
)}  # fmt: skip
DEFAULT = [name for name, c in CONFIGS.items() if not c.cluster]
ALIASES = {"per-instance": "kvtier-per-instance", "shared": "kvtier-shared", "file": "file-shared",
           "cluster": "kvtier-cluster"}


def resolve(names: list[str]) -> list[SharingConfig]:
    """Configuration names (or aliases), comma or space separated, in the canonical order, once each."""
    return configs.pick(names, CONFIGS, ALIASES, "configuration")


def request_log_args(directory: Path) -> list[str]:
    """SGLang's per-request log: one JSON line per received and finished request, metadata only."""
    return ["--log-requests", "--log-requests-level", "0", "--log-requests-format", "json",
            "--log-requests-target", str(directory)]


def pinning(cores: list[int], instances: int, per_server: int) -> list[list[int]]:
    """The CPUs each instance is pinned to (``taskset``): ``per_server`` consecutive usable CPUs each; no
    pinning (empty lists) when ``per_server`` is 0 or the machine has too few CPUs."""
    if per_server <= 0 or len(cores) < instances * per_server:
        return [[] for _ in range(instances)]
    ordered = sorted(cores)
    return [ordered[i * per_server:(i + 1) * per_server] for i in range(instances)]


def pinned_command(command: list[str], cpus: list[int]) -> list[str]:
    """``command`` under ``taskset -c <cpus>`` (unchanged without CPUs)."""
    return ["taskset", "-c", ",".join(map(str, cpus)), *command] if cpus else list(command)


def staging_tokens(concurrency: int, instances: int, max_context: int) -> int:
    """Host-pool room each instance needs for L3 loads: its share of the requests in flight x the longest."""
    return -(-concurrency // instances) * max_context


# -- who served what ---------------------------------------------------------------------------------


def predicted_workers(workload: Workload, instances: int = 2, offset: int = 0) -> dict[str, int]:
    """Round-robin's assignment when requests reach the router in order (phase after phase): rid -> instance."""
    return {r.rid: (offset + k) % instances for k, r in enumerate(workload.requests)}


def per_worker_unique_tokens(workload: Workload, page: int, assignment: dict[str, int], instances: int = 2) -> list[int]:
    """Distinct whole-page prefix tokens each instance sees over the run (its working set) under ``assignment``."""
    out = []
    for w in range(instances):
        mine = [r for r in workload.requests if assignment.get(r.rid) == w]
        out.append(len(workload.page_keys(mine, page)) * page)
    return out


def alternates(clients: int, instances: int = 2) -> bool:
    """Whether round-robin over ``instances`` sends every conversation's consecutive turns to different
    instances when each round sends all ``clients`` in order: ``clients`` must not be a multiple of it."""
    return clients % instances != 0


def parse_request_log(directory: Path) -> set[str]:
    """The request ids an instance logged (``request.received`` / ``request.finished``) under ``directory``."""
    rids: set[str] = set()
    if not directory.exists():
        return rids
    for path in sorted(directory.rglob("*.log*")):
        for line in path.read_text(errors="replace").splitlines():
            start = line.find("{")
            if start < 0:
                continue
            try:
                event = json.loads(line[start:])
            except ValueError:
                continue
            if isinstance(event, dict) and event.get("rid"):
                rids.add(str(event["rid"]))
    return rids


def attribute(records: list[dict[str, Any]], served: list[set[str]]) -> None:
    """Set ``worker`` on each record: the instance whose request log names its id (``meta_id``, else the
    rid sent), or the instance it was sent to directly (``via_instance``, client-side round-robin)."""
    for rec in records:
        ids = {str(x) for x in (rec.get("meta_id"), rec.get("sent_rid")) if x}
        hits = [w for w, rids in enumerate(served) if ids & rids]
        if len(hits) == 1:
            rec["worker"], rec["worker_source"] = hits[0], "request log"
        elif rec.get("via_instance") is not None:
            rec["worker"], rec["worker_source"] = rec["via_instance"], "sent directly"
        else:
            rec["worker"], rec["worker_source"] = None, "unknown" if not hits else "ambiguous"


def alternation(phases: list[dict[str, Any]]) -> dict[str, Any]:
    """How often a conversation's turn landed on another instance than its previous turn (all phases):
    transitions counted where both turns' instances are known."""
    turns: dict[str, list[tuple[int, int | None]]] = defaultdict(list)
    per_worker: dict[str, int] = defaultdict(int)
    for p in phases:
        for rec in p["requests"]:
            w = rec.get("worker")
            turns[rec.get("group", "")].append((p["phase"], w))
            per_worker["unknown" if w is None else str(w)] += 1
    switched = known = 0
    for seq in turns.values():
        seq.sort(key=lambda t: t[0])
        for (_, a), (_, b) in zip(seq, seq[1:]):
            if a is not None and b is not None:
                known += 1
                switched += a != b
    return {"transitions": known, "switched": switched, "fraction": switched / known if known else None,
            "requests_per_worker": dict(sorted(per_worker.items()))}


def ideal_cached_tokens(workload: Workload, page: int, assignment: dict[str, int]) -> dict[str, int]:
    """Prompt tokens of the measured phases that a cache could serve, per sharing mode, under ``assignment``:
    ``shared`` (any earlier prompt's whole pages, whichever instance computed them) and ``per_instance``
    (only pages of prompts the same instance served earlier). No eviction assumed: the upper bounds."""
    seen_any: set[bytes] = set()
    seen_by: dict[int, set[bytes]] = defaultdict(set)
    out = {"shared": 0, "per_instance": 0}
    for pi, phase in enumerate(workload.phases):
        for r in phase:
            keys = _chain(r, page)
            if pi > 0:
                out["shared"] += _leading(keys, seen_any) * page
                out["per_instance"] += _leading(keys, seen_by[assignment.get(r.rid, 0)]) * page
        for r in phase:
            keys = _chain(r, page)
            seen_any.update(keys)
            seen_by[assignment.get(r.rid, 0)].update(keys)
    return out


def _chain(req: Request, page: int) -> list[bytes]:
    import hashlib

    import numpy as np

    arr = np.asarray(req.tokens, dtype=np.int64)
    digest, out = b"", []
    for i in range(len(arr) // page):
        digest = hashlib.blake2b(digest + arr[i * page:(i + 1) * page].tobytes(), digest_size=16).digest()
        out.append(digest)
    return out


def _leading(keys: list[bytes], seen: set[bytes]) -> int:
    n = 0
    for k in keys:
        if k not in seen:
            break
        n += 1
    return n
