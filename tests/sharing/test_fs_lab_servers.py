"""Real SGLang 0.5.23 servers (CPU, tiny random model) on two lab hosts sharing one pool on JuiceFS
(``sharing = "cluster"``, no ``allow_local_fs``: the store must accept the mount as shared on its own).

Each server runs on its lab host (``fs_lab``: its own network, mount and UTS namespaces, hostname, boot id and
machine id), listens on the host's bridge address, and keeps its L3 pool on the host's JuiceFS mount. B is
served from storage a prompt only A saw, with A's greedy output, once B's view of A's lease counts the
prompt's pages (B's ``/metrics``). Page 16, 900-token prompts: ``HIT = 896`` tokens per prompt. The two
start-ups dominate the run time.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("sglang")

from test_cluster_servers import writer_samples  # noqa: E402
from test_shared_servers import (  # noqa: E402
    BACKED_UP,
    BOUNDARY_FAILURE,
    HIT,
    PAGES_PER_PROMPT,
    PROMPT,
    details,
    read,
    running,
    server_args,
    storage,
    why_no_hit,
)

from benchmarks.cluster.lab import Host, Lab  # noqa: E402
from sgl_kvtier.serving.launch import BACKEND  # noqa: E402
from sgl_kvtier.serving.model_factory import make_model, make_prompt  # noqa: E402
from sgl_kvtier.serving.server import SGLangServer, tracebacks_through  # noqa: E402
from sgl_kvtier.telemetry.prometheus import ENV_INTERVAL  # noqa: E402

pytestmark = [pytest.mark.server, pytest.mark.slow]

ANNOUNCED_S = 60.0  # longest B may take to see A's backed-up pages in A's lease (JuiceFS, 2 busy cores)


class LabServer(SGLangServer):
    """An SGLang server run on a lab host (``nsenter`` execs it: the pid is the server's) and reached on the
    host's bridge address."""

    def __init__(self, host: Host, model: Path, args: list[str], log: Path) -> None:
        super().__init__(model, extra_args=args, env={"OMP_NUM_THREADS": "1", ENV_INTERVAL: "0"}, log_path=log)
        self.env.pop("KVTIER_BOOT_ID", None)  # the host's own boot id counts
        self.command[self.command.index("--host") + 1] = host.address
        self.command = host.argv(*self.command)
        self.address = host.address
        self.url = f"http://{host.address}:{self.port}"

    def _move_to(self, port: int) -> None:
        super()._move_to(port)
        self.url = f"http://{self.address}:{port}"


def lab_args(pool: Path) -> list[str]:
    extra: dict[str, Any] = {
        **BACKEND, "devices": [str(pool)], "capacity_bytes": 64 << 20, "segment_bytes": 16 << 20,
        "sharing": "cluster", "heartbeat_s": 0.2, "dead_after_s": 5.0, "reclaim_after_s": 900.0,
    }  # fmt: skip
    return server_args(extra)


def test_a_server_on_one_host_serves_from_storage_a_prompt_only_the_other_host_saw(fs_lab: Lab,
                                                                                   tmp_path: Path) -> None:
    fs_lab.connect_client()
    model = make_model(tmp_path / "model", "tiny")
    pool = fs_lab.mount / "servers"
    fs_lab.hosts[0].run("mkdir", "-p", str(pool))
    p = make_prompt(PROMPT, seed=3, model_dir=model)
    logs = tmp_path / "a.log", tmp_path / "b.log"
    servers = [LabServer(host, model, lab_args(pool), log) for host, log in zip(fs_lab.hosts, logs)]
    t0 = time.monotonic()
    with running(*servers) as (a, b):
        started = time.monotonic() - t0
        cold = a.generate(p)
        assert storage(cold) == 0 and cold["meta_info"]["cached_tokens"] == 0
        assert a.wait_metric(BACKED_UP, HIT, timeout_s=180) == HIT
        # B sees A's pages once A's lease announces them (synced journal records only) and B has read it.
        deadline = time.monotonic() + ANNOUNCED_S
        while (seen := writer_samples(b, fs_lab.hosts[0].hostname)).get("kvtier_writer_pages", 0) < PAGES_PER_PROMPT:
            assert time.monotonic() < deadline, f"B never counted A's pages: {seen}"
            time.sleep(0.5)  # the poll's pace: B refreshes on its own scheduler steps
        assert seen["kvtier_writer_live"] == 1 and seen["pool_writers:live"] == 2, seen
        warm = b.generate(p)
        assert details(warm) == {**details(warm), "device": 0, "host": 0, "storage": HIT}, why_no_hit(b, logs[1])
        assert warm["output_ids"] == cold["output_ids"] and warm["text"] == cold["text"]
        print(f"start-ups {started:.0f} s; test {time.monotonic() - t0:.0f} s")
    for log in logs:
        text = read(log)
        assert tracebacks_through(text) == [] and not BOUNDARY_FAILURE.search(text)
