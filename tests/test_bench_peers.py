"""benchmarks.bench_peers: the systems' flags, the memory cgroup's sizing and readings, the overlay venv's rules,
skip-with-reason, the table, and a smoke run on real servers.

The smoke run (``--smoke``) starts two real SGLang servers on the CPU (tiny model), SGLang's ``file`` L3 and
sgl-kvtier (neither needs a package beyond the project's venv), each in its own memory cgroup where the machine has
one, one conversation of two rounds at C = 1 with L1 + L2 flushed between the rounds, so round 2 takes round 1's
prefix from L3. Two server start-ups (about a minute each on two cores) are nearly all of its time.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest

from benchmarks import bench_peers as bench
from benchmarks import bench_plan
from benchmarks.peers import SYSTEMS, cgroup, resolve
from benchmarks.peers import report as peers_report
from benchmarks.peers.seaweedfs import GRPC_OFFSET
from benchmarks.peers.system import Context, Skip, System, bindable
from benchmarks.peers.venv import CONSTRAINTS, PeersVenv, canonical, conflicts, installed, pins
from benchmarks.serving import configs
from sgl_kvtier.serving import summary
from sgl_kvtier.serving.hardware import ENV_DTYPE

GB = 10**9


def ctx(tmp_path: Path, name: str = "x", venv: PeersVenv | None = None) -> Context:
    plan = configs.ServerPlan(page_size=16, device_tokens=1024, host_ratio=2.0, host_size_gb=0, gpu=False,
                              l3_root=tmp_path / "l3", kvtier_capacity_bytes=GB)
    return Context(plan=plan, work=tmp_path / "l3" / name, venv=venv or PeersVenv(tmp_path / "venv"),
                   kv_bytes_per_token=131072, host_pool_bytes=2048 * 131072, working_set_bytes=6 * 2048 * 131072,
                   log_dir=tmp_path / "logs", run_id="run1")


# -- systems ---------------------------------------------------------------------------------------


def test_every_system_in_order_and_names_resolve() -> None:
    assert list(SYSTEMS) == ["recompute", "radix", "file", "kvtier", "mooncake-dram", "mooncake-ssd", "nixl",
                             "lmcache", "aibrix", "seaweedfs"]
    assert [s.name for s in resolve(["kvtier", "file-l3,recompute", "mooncake"])] == [
        "recompute", "file", "kvtier", "mooncake-dram"]
    with pytest.raises(ValueError, match="unknown system 'hf3fs'"):
        resolve(["hf3fs"])
    for s in SYSTEMS.values():  # every package a peer needs is pinned in the benchmark's own constraints
        assert all(canonical(p) in pins() for p in s.packages), s.name
    assert not SYSTEMS["file"].packages and not SYSTEMS["kvtier"].packages


def test_builtin_systems_take_bench_servings_flags(tmp_path: Path) -> None:
    c = ctx(tmp_path, "file")
    args = SYSTEMS["file"].server_args(c)
    assert args[args.index("--hicache-storage-backend") + 1] == "file"
    assert json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1]) == {
        "file_storage_path": str(c.work)}
    k = SYSTEMS["kvtier"].server_args(ctx(tmp_path, "kvtier"))
    extra = json.loads(k[k.index("--hicache-storage-backend-extra-config") + 1])
    assert extra["class_name"] == "KVTierStorage" and extra["devices"] == [str(tmp_path / "l3" / "kvtier")]
    assert "--disable-radix-cache" in SYSTEMS["recompute"].server_args(c)
    assert "--enable-hierarchical-cache" not in SYSTEMS["radix"].server_args(c)
    assert not SYSTEMS["recompute"].flush and not SYSTEMS["radix"].l3 and SYSTEMS["file"].l3


def extra_config(args: list[str]) -> dict:
    return json.loads(args[args.index("--hicache-storage-backend-extra-config") + 1])


def flag(command: list[str], name: str) -> str:
    """The value of ``-name=value`` / ``--name=value`` in a service's command."""
    (value,) = [a.split("=", 1)[1] for a in command if a.lstrip("-").startswith(name + "=")]
    return value


def test_peer_flags_and_environment(tmp_path: Path) -> None:
    c = ctx(tmp_path, "mooncake-ssd")
    moon = SYSTEMS["mooncake-ssd"]
    extra = extra_config(moon.server_args(c))  # asked before the services: the same ports either way
    (svc,) = moon.services(c)
    assert "--enable_offload=true" in svc.command and svc.command[0].endswith("mooncake_master")
    assert extra["master_server_address"] == f"127.0.0.1:{flag(svc.command, 'rpc_port')}"
    assert extra["metadata_server"] == f"http://127.0.0.1:{flag(svc.command, 'http_metadata_server_port')}/metadata"
    assert extra["enable_ssd_offload"] and extra["ssd_offload_path"] == str(c.work / "ssd")
    assert extra["global_segment_size"] == 256 << 20  # the host pool's bytes: the working set must spill
    assert moon.server_env(c) == {"MOONCAKE_OFFLOAD_STORAGE_BACKEND_DESCRIPTOR": "file_per_key_storage_backend"}
    assert moon.readings(c) == {}  # no master listening: nothing read, nothing raised
    dram = SYSTEMS["mooncake-dram"]
    assert dram.dram_store_bytes(c) > c.working_set_bytes and dram.server_env(c) == {}
    nixl = SYSTEMS["nixl"]
    assert nixl.server_env(c)["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] == str(c.work)
    assert "--enable-hierarchical-cache" in nixl.server_args(c)
    assert extra_config(nixl.server_args(c)) == {"l3_cleaner_enabled": False}  # keeps what it writes, as the others
    lm = SYSTEMS["lmcache"]
    (daemon,) = lm.services(c)
    assert "--supported-transfer-mode" in daemon.command and "--disable-observability" in daemon.command
    a = lm.server_args(c)
    assert "--enable-lmcache" in a and "--enable-hierarchical-cache" not in a and not lm.hicache and not lm.l3
    port = daemon.command[daemon.command.index("--port") + 1]
    assert (c.work / "lmcache.yaml").read_text() == f"mp_host: 127.0.0.1\nmp_port: {port}\n"
    env = SYSTEMS["aibrix"].server_env(c)
    assert env["AIBRIX_KV_CACHE_OL_L2_CACHE_BACKEND"] == "ROCKSDB" and env["KVTIER_BENCH_AIBRIX_CPU"] == "1"
    sw = SYSTEMS["seaweedfs"]
    (weed,) = sw.services(c)
    assert "-s3" in weed.command and sw.server_env(c)["AWS_ACCESS_KEY_ID"]
    sw_extra = extra_config(sw.server_args(c))
    assert sw_extra["prefix"] == "run1" and sw_extra["endpoint"] == f"http://127.0.0.1:{flag(weed.command, 's3.port')}"
    weed_ports = [int(flag(weed.command, f"{k}.port")) for k in ("master", "volume", "filer", "s3")]
    assert len(set(weed_ports)) == 4 and all(bindable(p + GRPC_OFFSET) for p in weed_ports)  # its gRPC ports too
    # every port of the context differs from every other one
    assert len(set(c.ports.values())) == len(c.ports)


def test_a_peer_whose_tool_is_missing_is_skipped_with_the_reason(tmp_path: Path) -> None:
    class NoTool(System):
        name, tools = "notool", ("no-such-tool",)

    with pytest.raises(Skip, match=r"no-such-tool not found in .*venv/bin"):
        NoTool().prepare(ctx(tmp_path), install=False)


def test_the_aibrix_hook_turns_pinned_memory_off(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The overlay's import hook sets the constant on the real module object once it is imported."""
    import subprocess
    import sys

    from benchmarks.peers import aibrix

    pkg = tmp_path / "aibrix_kvcache"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "cache_manager.py").write_text("TESTING_DISABLE_PIN_MEMORY = False\n")
    (tmp_path / "_kvtier_bench_aibrix_cpu.py").write_text(aibrix.HOOK)
    code = ("import _kvtier_bench_aibrix_cpu\nimport aibrix_kvcache.cache_manager as m\n"
            "print(m.TESTING_DISABLE_PIN_MEMORY)")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # dead, not yet reaped by whoever inherited it


def test_a_service_is_stopped_with_everything_it_started(tmp_path: Path) -> None:
    """A service whose launcher exits on SIGTERM, leaving a child that ignores it: the child is gone after ``stop``
    too (the sweep of the process group)."""
    import sys
    import time

    from benchmarks.peers.system import Service

    pidfile = tmp_path / "child.pid"
    child = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    cmd = ["/bin/sh", "-c", f"{sys.executable} -c '{child}' & echo $! > {pidfile}.tmp; mv {pidfile}.tmp {pidfile}; wait"]
    svc = Service("svc", cmd, tmp_path / "svc.log", pidfile.exists, timeout_s=30)
    svc.start(None)
    assert svc.proc is not None and svc.startup_s is not None
    pid = int(pidfile.read_text())
    try:
        svc.stop(grace_s=1.0)
        assert svc.proc.poll() == -15 and svc.record()["exit_code"] == -15
        deadline = time.monotonic() + 10
        while not _gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _gone(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # a failing test leaves nothing behind either


def test_a_service_that_dies_at_start_up_skips_its_system_with_the_log(tmp_path: Path) -> None:
    from benchmarks.peers.system import Service

    svc = Service("svc", ["/bin/sh", "-c", "echo no such bucket >&2; exit 3"], tmp_path / "svc.log", lambda: False)
    with pytest.raises(Skip, match="svc exited with code 3 at start-up: no such bucket"):
        svc.start(None)


# -- the overlay venv and skip-with-reason ---------------------------------------------------------------


def test_constraints_pin_every_peer_and_the_venv_never_shadows_a_pinned_package(tmp_path: Path) -> None:
    p = pins()
    assert p["lmcache"] == "0.5.6" and p["aibrix-kvcache"] == "0.8.0" and p["nixl"] == "1.5.1"
    assert CONSTRAINTS.parent.name == "peers" and "scripts" not in str(CONSTRAINTS)
    site = tmp_path / "site"
    (site / "Foo_Bar-1.0.dist-info").mkdir(parents=True)
    (site / "Foo_Bar-1.0.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: Foo_Bar\nVersion: 1.0\n\nx")
    assert installed(site) == {"foo-bar": "1.0"}
    assert conflicts({"foo-bar": "2.0", "baz": "1"}, installed(site)) == {"foo-bar": ("1.0", "2.0")}
    assert conflicts({"foo-bar": "1.0"}, installed(site)) == {}


def test_a_system_whose_package_is_missing_is_skipped_with_the_reason(tmp_path: Path) -> None:
    class Ghost(System):
        name, packages = "ghost", ("lmcache",)

    venv = PeersVenv(tmp_path / "venv")
    with pytest.raises(Skip, match=r"not installed in venv: lmcache \(run with --install\)"):
        Ghost().prepare(ctx(tmp_path, venv=venv), install=False)

    class Unpinned(System):
        name, packages = "unpinned", ("no-such-package-kvtier",)

    with pytest.raises(Skip, match="not pinned in constraints.txt: no-such-package-kvtier"):
        Unpinned().prepare(ctx(tmp_path, venv=venv), install=True)
    assert not venv.path.exists()  # nothing was made for a system that cannot install

    # run_system records the reason, starts nothing and makes no cgroup
    args = bench.parse_args(["--systems", "file", "--no-install", "--out", str(tmp_path / "out")])
    args.gpu = False

    class Bars:
        def update(self, *a: object, **k: object) -> None: ...

    res = bench.run_system(args, Ghost(), ctx(tmp_path, "ghost", venv), tmp_path, {}, False, Bars(), None,
                           bench.session.make_console(), None)
    assert res["skipped"].startswith("not installed in venv: lmcache") and "command" not in res
    assert res["versions"] == {"lmcache": "not installed"}

    class NoPort(System):  # its services cannot be set up: skipped with the reason, and the next system runs
        name = "noport"

        def services(self, c: Context) -> list:
            raise Skip("no free port for s3")

    c = ctx(tmp_path, "noport", venv)
    res = bench.run_system(args, NoPort(), c, tmp_path, {}, False, Bars(), None, bench.session.make_console(), None)
    assert res["skipped"] == "no free port for s3" and "command" not in res and res["services"] == []
    assert not c.work.exists()  # its directory went (no --keep-l3)


# -- the memory cgroup ---------------------------------------------------------------------------------------


def test_the_limit_follows_resident_memory_and_leaves_the_page_cache_the_allowance(tmp_path: Path) -> None:
    stat = {"total_rss": 1500 * cgroup.MiB, "total_mapped_file": 400 * cgroup.MiB, "total_shmem": 10 * cgroup.MiB,
            "total_cache": 3000 * cgroup.MiB}  # the model files' page cache does not count: it can be reclaimed
    assert cgroup.resident(stat) == 1910 * cgroup.MiB
    assert cgroup.limit_for(stat, 256 * cgroup.MiB, 128 * cgroup.MiB) == (1910 + 384) * cgroup.MiB
    assert cgroup.allowance_warning(384 * cgroup.MiB, 2048 * cgroup.MiB) is None
    assert "may be served from the page cache" in cgroup.allowance_warning(384 * cgroup.MiB, 1024 * cgroup.MiB)
    # a cgroup directory of plain files: the cap sets limit_for its stat, and records what it did
    cg = cgroup.MemoryCgroup(tmp_path)
    (tmp_path / "memory.stat").write_text("total_rss 1000\ntotal_mapped_file 20\ntotal_shmem 4\ntotal_cache 500\n")
    (tmp_path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    cap = cgroup.Cap(cg, 100, 10, interval_s=0.01).start()
    assert cg.limit() == 1024 + 110
    (tmp_path / "memory.stat").write_text("total_rss 5000\ntotal_mapped_file 20\ntotal_shmem 4\ntotal_cache 500\n")
    import time

    deadline = time.monotonic() + 10
    while cg.limit() != 5024 + 110 and time.monotonic() < deadline:
        time.sleep(0.01)
    followed = cg.limit()
    assert (tmp_path / "memory.oom_control").read_text() == "1\n"  # the OOM killer switched off
    cap.stop()
    rec = cap.record()
    assert followed == 5134 and rec["limit_low_bytes"] == 1134 and rec["limit_high_bytes"] == 5134
    assert rec["updates"] >= 2 and rec["refused"] == 0 and "allowance" in rec["rule"]
    assert cg.limit() == cgroup.UNLIMITED  # lifted: nothing waits on a limit nobody raises any more


def test_cgroup_files_are_read_as_the_kernel_writes_them(tmp_path: Path) -> None:
    mount = tmp_path / "memory"
    (mount / "a" / "b").mkdir(parents=True)
    (mount / "cgroup.procs").write_text("")
    proc = tmp_path / "cgroup"
    proc.write_text("5:cpu:/\n4:memory:/a/b\n0::/\n")
    assert cgroup.own(mount, proc) == mount / "a" / "b"
    assert cgroup.own(tmp_path / "nowhere", proc) is None
    cg = cgroup.MemoryCgroup(mount / "a" / "b")
    files = {"memory.stat": "cache 5\nrss 7\ntotal_cache 100\ntotal_rss 200\ntotal_shmem 1\ntotal_mapped_file 30\n"
                            "total_pgmajfault 3\ntotal_pgpgin 9\n",
             "memory.usage_in_bytes": "300\n", "memory.max_usage_in_bytes": "350\n", "memory.failcnt": "2\n",
             "memory.oom_control": "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n", "cgroup.procs": f"{os.getpid()}\n",
             "memory.limit_in_bytes": "9223372036854771712\n"}
    for name, text in files.items():
        (cg.path / name).write_text(text)
    snap = cg.snapshot()
    assert snap["total_cache"] == 100 and snap["total_pgmajfault"] == 3 and snap["peak_bytes"] == 350
    assert snap["failcnt"] == 2 and snap["oom_kills"] == 1 and snap["read_bytes"] >= 0
    assert peers_report.unmapped_cache(snap) == 69
    cg.set_limit(1234)
    assert cg.limit() == 1234
    wrapped = cg.wrap(["python", "-V"])
    assert wrapped[:2] == ["/bin/sh", "-c"] and wrapped[-2:] == ["python", "-V"] and wrapped[4].endswith("cgroup.procs")


def test_the_wrapper_puts_the_command_in_the_cgroup(tmp_path: Path) -> None:
    """The shell writes its own pid, then execs: the command runs as that pid (a fake cgroup.procs file here)."""
    import subprocess

    cg = cgroup.MemoryCgroup(tmp_path)
    out = subprocess.run(cg.wrap(["/bin/sh", "-c", "echo $$"]), capture_output=True, text=True, check=True)
    assert (tmp_path / "cgroup.procs").read_text().strip() == out.stdout.strip()


# -- report -------------------------------------------------------------------------------------------------


def _level(c: int, ttft: float, storage: int, outputs: list[int], cache: float = 0.0,
           store: dict | None = None) -> dict:
    reqs = [{"rid": f"c{i}-r2", "ttft_s": ttft, "latency_s": ttft, "prompt_tokens": 500, "cached_device": 0,
             "cached_host": 0, "cached_storage": storage, "output_ids": outputs} for i in range(2)]
    snap = {"total_cache": 100e6 + cache, "total_mapped_file": 100e6, "total_shmem": 0.0, "total_pgmajfault": 10.0,
            "peak_bytes": 2e9, "read_bytes": 1e6}
    after = snap | {"total_pgmajfault": 25.0, "read_bytes": 51e6} | (store or {})
    phases = [{"measured": False, "wall_s": 1.0, "requests": reqs, "metrics_delta": {}},
              {"measured": True, "wall_s": 2.0, "requests": reqs, "metrics_delta": {}, "probe_before": snap,
               "probe_after": after}]
    return {"concurrency": c, "phases": phases, "summary": summary.summarize(phases, 1000)}


def _fake_run() -> dict:
    systems = {
        "recompute": {"storage": "none", "summary": "r", "workloads": {"multiturn": [_level(1, 4.0, 0, [1, 2])]}},
        "kvtier": {"storage": "flash", "summary": "k", "versions": {"sglang": "0.5.23", "sgl-kvtier": "0.1.0"},
                   "cgroup": {"cap": {"limit_low_bytes": 2 * GB, "limit_high_bytes": 3 * GB, "updates": 40,
                                      "refused": 1, "oom_control": {"oom_kill": 0}}},
                   "workloads": {"multiturn": [_level(1, 1.0, 400, [1, 2], cache=30e6)]}},
        "mooncake-dram": {"storage": "dram", "summary": "m", "dram_store_bytes": 2 * GB,
                          "workloads": {"multiturn": [_level(1, 0.8, 400, [1, 3],
                                                              store={"dram_allocated_bytes": 300e6})]}},
        "nixl": {"storage": "flash", "summary": "n", "skipped": "pip install failed (nixl==1.5.1): no network",
                 "workloads": {}},
    }
    return {"started": "now", "command": "python -m benchmarks.bench_peers --concurrency 1", "gpu": False, "model": {"name": "kvheavy", "kv_bytes_per_token": 131072},
            "sizing": {"page_size": 16, "device_tokens": 100, "host_tokens": 200, "host_pool_bytes": 200 * 131072,
                       "working_set_bytes": 10**9, "page_cache_allowance_bytes": 256 * 2**20,
                       "margin_bytes": 128 * 2**20},
            "cgroup": {"used": True, "why_not": None, "warning": None}, "page_cache": {"policy": "dropped"},
            "workload_info": {"multiturn": {"description": "d"}}, "concurrency": [1],
            "system_order": list(systems), "systems": systems}


def test_table_outputs_check_and_png(tmp_path: Path) -> None:
    run = _fake_run()
    peers_report.compare_outputs(run)
    assert run["systems"]["kvtier"]["outputs_vs_recompute"]["same"] == 2
    assert run["systems"]["mooncake-dram"]["outputs_vs_recompute"] == {
        "concurrency": 1, "compared": 2, "same": 0, "differ": ["c0-r2", "c1-r2"]}
    assert run["systems"]["nixl"]["outputs_vs_recompute"] is None
    md = peers_report.markdown(run)
    row = next(line for line in md.splitlines() if line.startswith("| kvtier |"))
    cells = [c.strip() for c in row.strip("|").split("|")]
    head = dict(zip(peers_report.HEAD, cells))
    assert head["TTFT p50 s"] == "1.00" and head["tok from storage"] == "800" and head["outputs = recompute"] == "2/2"
    assert head["tok computed"] == "200" and head["major faults"] == "15" and head["disk read MB"] == "50"
    assert head["page cache MB"] == "30" and head["cgroup peak MB"] == "2000"
    assert head["DRAM store MB used / size"] == "-"
    moon = dict(zip(peers_report.HEAD, [c.strip() for c in next(
        line for line in md.splitlines() if line.startswith("| mooncake-dram |")).strip("|").split("|")]))
    assert moon["DRAM store MB used / size"] == "300 / 2000"  # what its master reported of the 2 GB segment
    assert moon["outputs = recompute"] == "0/2" and moon["L3 in"] == "dram"
    assert "`python -m benchmarks.bench_peers --concurrency 1`" in md
    assert "- **nixl** skipped: pip install failed (nixl==1.5.1): no network" in md
    assert "sgl-kvtier 0.1.0" in md and "- **kvtier**: 2000 to 3000 MB over 40 updates (1 refused" in md
    err = ("ServerError('SGLang server exited with code -9 during start-up.\\ncommand: python -m sglang.launch_server"
           "\\nlog tail:\\n  File x\\nValueError: Not enough host memory available. Requesting 0.00 GB\\n')")
    assert peers_report.cause(err) == "ValueError: Not enough host memory available. Requesting 0.00 GB"
    (png,) = peers_report.plots(run, tmp_path)
    assert png.name == "peers.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert peers_report.caption(run).splitlines() == ["bench_peers now; machine not recorded", run["command"]]


def test_smoke_flags_fill_in_what_is_not_given() -> None:
    args = bench.parse_args(["--smoke", "--clients", "2", "--rounds=3"])
    assert [s.name for s in args.systems] == ["recompute", "kvtier"] and args.model == "tiny"
    assert args.clients == 2 and args.rounds == 3  # explicit flags win, in either spelling
    assert args.flush_between_phases and args.concurrency == [1] and not args.install
    assert bench.parse_args(["--smoke", "--install"]).install
    plain = bench.parse_args([])
    assert plain.concurrency == [1, 4, 16] and plain.model == "kvheavy" and plain.install and len(plain.systems) == 10


# -- the smoke run ------------------------------------------------------------------------------------


@pytest.mark.server
def test_smoke_run_recompute_and_kvtier(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The harness end to end on the baseline and sgl-kvtier (the peers need ``.venv-peers``): both measured,
    kvtier's round 2 served from L3 after the flush, the same greedy tokens as recomputing them."""
    pytest.importorskip("sglang")
    monkeypatch.delenv(ENV_DTYPE, raising=False)
    out = tmp_path / "out"
    assert bench.main(["--smoke", "--no-progress", "--cpu", "--out", str(out)]) == 0
    for name in ("results.json", "report.md", "peers.png"):
        assert (out / name).stat().st_size > 0, name
    run = json.loads((out / "results.json").read_text())
    assert run["smoke"] and list(run["systems"]) == ["recompute", "kvtier"]
    assert run["command"].endswith("--smoke --no-progress --cpu --out " + str(out))
    assert run["hash_extension"]["ok"], run["hash_extension"]
    if "TORCH_EXTENSIONS_DIR" not in os.environ:  # built (or found) where the next run finds it
        assert run["hash_extension"]["dir"] == str(bench.hash_extension_dir())
    outputs = {}
    for name, res in run["systems"].items():
        assert "error" not in res and "skipped" not in res, res.get("error") or res.get("skipped")
        assert res["versions"]["sglang"] and res["command"].count("sglang.launch_server") == 1
        assert res["exit_code"] is not None  # stopped
        (level,) = res["workloads"]["multiturn"]
        first, second = level["phases"]
        assert first["requests"][0]["cached_storage"] == 0  # round 1: a cold store
        (rec,) = second["requests"]
        # kvtier: round 2 after the flush, round 1's whole prompt (24 pages) from L3; recompute: nothing cached
        want = 384 if name == "kvtier" else 0
        assert rec["cached_storage"] == want and rec["cached_device"] == 0 and "error" not in rec, rec
        outputs[name] = rec["output_ids"]
        if run["cgroup"]["used"]:
            cap = res["cgroup"]["cap"]
            assert cap["allowance_bytes"] == 64 * 2**20 and cap["updates"] > 0 and cap["oom_control"]["oom_kill"] == 0
            room = cap["allowance_bytes"] + cap["margin_bytes"] + 2**20  # pages charged between two updates
            assert peers_report.unmapped_cache(second["probe_after"]) <= room
            assert not Path(res["cgroup"]["path"]).exists()  # torn down
        assert not Path(res["store"]["path"]).exists()  # the store went with it (no --keep-l3)
    assert outputs["recompute"] == outputs["kvtier"]  # greedy: the same tokens as computing them
    if run["cgroup"]["used"]:
        assert not (cgroup.own() / f"kvtier-peers-{os.getpid()}").exists()  # the run's parent cgroup too
    assert run["systems"]["kvtier"]["versions"]["sgl-kvtier"]
    md = (out / "report.md").read_text()
    assert "| recompute | none | 1 |" in md and "| kvtier | flash | 1 |" in md
    # the planner on the same requests (bench_plan): the flush, then round 2 from the L3, as measured
    bench_plan.main(["--run", str(out), "--read-gbps", "1"])  # one L3 read: too few to fit the read path on
    check = json.loads((out / "plan-check.json").read_text())
    (lv,) = check["levels"]
    assert lv["requests"] == 1 and lv["predicted"]["by_tier"] == lv["measured"]["by_tier"]
    assert lv["predicted"]["by_tier"]["storage"] > 0.5 and check["read"]["from"] == "given"
    assert (out / "plan-check.png").stat().st_size > 0 and "| 1 | 1 |" in (out / "plan-check.md").read_text()
