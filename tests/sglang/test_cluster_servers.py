"""Real SGLang 0.5.23 servers (CPU, tiny random models) sharing one kvtier store as two "hosts" (``sharing =
"cluster"``).

Two servers on one directory, each with its own ``host_id`` and ``KVTIER_BOOT_ID`` (two machines as far as
the store can tell), ``allow_local_fs`` (this machine's disk is a local filesystem: cluster mode refuses it
otherwise), ``direct_io = "auto"`` (on, under cluster) and a short heartbeat. Across hosts nothing is seen
before its writer's lease announces it, and liveness is the lease counter watched on the observer's clock:

* B is served from storage a prompt only A saw, with A's greedy output, once A's backup is done and A's
  LEASE announces its pages (``sharing.lease.read_lease``: the lease publishes synced journal records only,
  with the page count of that same moment). B's ``/metrics`` show A live, watched (its lease's
  ``unchanged_s``), in a pool of two live writers.
* A is SIGKILLed: B's watch judges it dead after ``dead_after_s`` of a lease standing still (seen on B's
  ``/metrics``: ``kvtier_writer_live`` 0), and B still serves every page A announced, whole, with A's
  answers (dead writers stay readable; retiring one takes ``reclaim_after_s``, far beyond the test).

Page 16, 900-token prompts: ``HIT = 896`` tokens per prompt. No throttle: nothing here happens mid-backup.
The two start-ups dominate the run time.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import pytest

pytest.importorskip("sglang")

from test_shared_servers import (  # noqa: E402
    BACKED_UP,
    BOUNDARY_FAILURE,
    HIT,
    PAGES_PER_PROMPT,
    PROMPT,
    details,
    read,
    running,
    server,
    server_args,
    storage,
    why_no_hit,
)

from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer, tracebacks_through  # noqa: E402
from sgl_kvtier.sharing.lease import read_lease  # noqa: E402
from sgl_kvtier.store.meta import LEASE
from sgl_kvtier.telemetry.prometheus import ENV_INTERVAL  # noqa: E402

pytestmark = pytest.mark.server  # starts real SGLang servers

HEARTBEAT_S = 0.2
DEAD_AFTER_S = 2.0  # 10 beats: a live writer on 2 busy cores is never judged dead by a late beat
HOSTS = ("hosta", "hostb")
_T = TypeVar("_T")


def cluster_args(store: Path, host: str) -> list[str]:
    extra: dict[str, Any] = {
        **BACKEND, "devices": [str(store)], "capacity_bytes": 256 << 20, "sharing": "cluster",
        "allow_local_fs": True, "direct_io": "auto", "host_id": host, "heartbeat_s": HEARTBEAT_S,
        "dead_after_s": DEAD_AFTER_S, "reclaim_after_s": 900.0,
    }  # fmt: skip
    return server_args(extra)


def host_server(model: Path, store: Path, host: str, log: Path) -> SGLangServer:
    # Its own boot id: a process of this kernel standing for another machine (store.writers.BOOT_ID_ENV).
    return server(model, cluster_args(store, host), log, KVTIER_BOOT_ID=f"boot-{host}", **{ENV_INTERVAL: "0"})


def wait_for(what: str, probe: Callable[[], _T | None], timeout_s: float, poll_s: float = 0.1) -> _T:
    """``probe()`` once it is not None (polled), or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while (got := probe()) is None:
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        time.sleep(poll_s)
    return got


def wait_for_samples(what: str, srv: Any, ok: Callable[[dict[str, float]], bool], timeout_s: float) -> dict[str, float]:
    """``srv``'s samples about host A's writer (``writer_samples``) once ``ok`` holds (polled every 0.5 s), or fail
    naming ``what`` and the last figures seen."""
    last: dict[str, float] = {}

    def probe() -> dict[str, float] | None:
        last.update(writer_samples(srv, HOSTS[0]))
        return dict(last) if ok(last) else None

    try:
        return wait_for(what, probe, timeout_s=timeout_s, poll_s=0.5)
    except AssertionError as exc:
        raise AssertionError(f"{exc}; {srv}'s last figures on A: {last}") from None


def announced(store: Path, host: str, pages: int) -> int | None:
    """The pages the LEASE of ``host``'s one writer announces now, once they are at least ``pages``."""
    leases = [read_lease(p) for p in store.glob(f"ns-*/w-{host}-*/{LEASE}")]
    found = [lease for lease in leases if lease is not None]
    assert len(found) <= 1, found  # one pool (kv), one writer per host
    n = int(found[0]["pages"]) if found else 0
    return n if n >= pages else None


def writer_samples(srv: SGLangServer, host: str) -> dict[str, float]:
    """B's ``kvtier_writer_*`` / ``kvtier_pool_*`` samples about ``host``'s writer and the pool, by name
    (``pool_writers`` as ``pool_writers:<state>``)."""
    from prometheus_client.parser import text_string_to_metric_families

    status, raw = srv.request("GET", "/metrics", None, timeout_s=30.0)
    assert status == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(raw.decode()):
        for s in family.samples:
            if s.name.startswith("kvtier_writer_") and s.labels.get("host") == host:
                out[s.name] = s.value
            elif s.name == "kvtier_pool_writers":
                out[f"pool_writers:{s.labels['state']}"] = s.value
            elif s.name.startswith("kvtier_pool_"):
                out[s.name] = s.value
    return out


def test_two_hosts_share_one_store_and_a_dead_hosts_pages_stay_readable(tmp_path: Path) -> None:
    model = make_model(tmp_path / "model", "tiny")
    store = tmp_path / "flash"
    store.mkdir()
    p = make_prompt(PROMPT, seed=3, model_dir=model)
    qs = [make_prompt(PROMPT, seed=60 + i, model_dir=model) for i in range(2)]
    logs = tmp_path / "a.log", tmp_path / "b.log"
    t0 = time.monotonic()
    with running(*(host_server(model, store, h, log) for h, log in zip(HOSTS, logs))) as (a, b):
        started = time.monotonic() - t0
        # (a) B never saw P: once A's lease announces P's pages, B is served them, with A's greedy output.
        a_cold = a.generate(p)
        assert storage(a_cold) == 0 and a_cold["meta_info"]["cached_tokens"] == 0
        assert a.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        wait_for("A's lease announces P's pages", lambda: announced(store, HOSTS[0], PAGES_PER_PROMPT), timeout_s=30)
        b_warm = b.generate(p)
        assert details(b_warm) == {**details(b_warm), "device": 0, "host": 0, "storage": HIT}, why_no_hit(b, logs[1])
        assert b_warm["output_ids"] == a_cold["output_ids"] and b_warm["text"] == a_cold["text"]
        # B's figures are a snapshot taken on its scheduler steps: the one its /metrics shows right after serving
        # P may predate the lease read that announced P's pages (seen once in CI: 0 pages).
        seen = wait_for_samples("B's metrics count A's pages", b,
                                lambda s: s.get("kvtier_writer_pages", 0) >= PAGES_PER_PROMPT, timeout_s=30)
        assert seen["kvtier_writer_live"] == 1 and seen["pool_writers:live"] == 2, seen
        assert seen["kvtier_writer_pages"] >= PAGES_PER_PROMPT, seen
        assert 0 <= seen["kvtier_writer_lease_unchanged_seconds"] < DEAD_AFTER_S, seen  # watched, beating
        assert seen["kvtier_pool_peers_dropped"] == seen["kvtier_pool_writers_retired"] == 0, seen

        # (b) A dies once its lease announced Q's pages too: B judges it dead and still serves its pages.
        cold = [a.generate(q) for q in qs]
        assert a.wait_metric(BACKED_UP, 3 * HIT, timeout_s=180) == 3 * HIT
        wait_for("A's lease announces Q's pages", lambda: announced(store, HOSTS[0], 3 * PAGES_PER_PROMPT),
                 timeout_s=30)
        assert a.proc is not None
        os.killpg(a.proc.pid, signal.SIGKILL)
        a.proc.wait(timeout=30)
        killed = time.monotonic()
        # refreshed on B's scheduler steps, idle ones too
        dead = wait_for_samples("B judges A dead", b, lambda s: s.get("kvtier_writer_live") == 0, timeout_s=60)
        judged_s = time.monotonic() - killed
        assert dead["pool_writers:dead"] == 1 and dead["pool_writers:live"] == 1, dead
        assert dead["kvtier_writer_lease_unchanged_seconds"] >= DEAD_AFTER_S, dead
        assert dead["kvtier_writer_pages"] >= 3 * PAGES_PER_PROMPT, dead  # its pages still counted: not retired
        warm = [b.generate(q) for q in qs]
        assert [storage(w) for w in warm] == [HIT] * len(qs), [details(w) for w in warm]
        assert [w["output_ids"] for w in warm] == [c["output_ids"] for c in cold]
        b.flush_cache()
        again = b.generate(p)  # P once more, from A's pages alone: B's own L1/L2 copy was flushed
        assert storage(again) == HIT and again["output_ids"] == a_cold["output_ids"], details(again)
        print(f"start-ups {started:.0f} s; A judged dead {judged_s:.1f} s after SIGKILL; "
              f"test {time.monotonic() - t0:.0f} s")
        b_log = read(logs[1])
    assert tracebacks_through(b_log) == [] and not BOUNDARY_FAILURE.search(b_log)
    assert tracebacks_through(read(logs[0])) == []
