"""benchmarks.gpu_stream's CPU-safe parts: the page geometries and their layer groups, the host landing
buffer's runs (both layouts) against the flat page the store keeps, the verified-groups-only rule of the
streamed path on a real store with a corrupted part, and a whole ``--cpu-check`` run (the GPU script's own
code on CPU tensors, a few seconds). Timings are recorded, never asserted."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import gpu_stream
from benchmarks.gpu import kvstore, pipeline
from benchmarks.gpu.geometry import GEOMETRIES, Geometry
from benchmarks.gpu.prefill import StandIn
from sgl_kvtier.io.buffers import view

TINY = Geometry("tiny", 8, 16, 2, 64, "bfloat16", 4, 64, 64, 64, 4, "test")  # 4 KiB per layer and range


def test_geometries_and_their_groups() -> None:
    kvh, big = GEOMETRIES["kvheavy"], GEOMETRIES["480b-tp8"]
    assert kvh.page_bytes == 2 << 20 and kvh.kv_bytes_per_token == 128 << 10 and kvh.prefix_bytes == 1536 * (128 << 10)
    assert big.page_bytes == 992 << 10 and big.kv_bytes_per_token == 15872 and big.pages == 1024
    plan = kvh.plan(8)
    assert plan.bounds == (0, 8, 16, 24, 32, 40, 48, 56, 64) and len(plan.parts) == 16
    assert plan.groups[1] == [1, 9] and plan.part_range(8) == (64 * kvh.layer_bytes, 8 * kvh.layer_bytes)
    assert big.plan(8).group_of(61) == 7 and big.plan(1).parts == (62 * 8192, 62 * 8192)
    check = big.for_cpu_check()
    assert (check.layers, check.page_bytes, check.pages) == (62, big.page_bytes, 4) and check.suffix_tokens < 16
    assert big.layer_flops() > 1e11  # the suffix's layer is real work (2k tokens over a 64k prefix)
    for bad in ({"kv_dtype": "int4"}, {"prefix_tokens": 20}, {"q_heads": 3}):
        with pytest.raises(ValueError):
            Geometry(**{**TINY.__dict__, **bad})
    with pytest.raises(ValueError):
        TINY.plan(9)


@pytest.mark.parametrize("layout", kvstore.LAYOUTS)
def test_host_runs_are_the_flat_page(layout: str) -> None:
    canonical = kvstore.canonical_pages(TINY, seed=3)
    host = kvstore.HostKV(TINY, layout, pin=False)
    assert host.data.data_ptr() % 4096 == 0
    host.fill(canonical)
    for i, runs in enumerate(host.runs()):
        flat = b"".join(bytes(view(addr, n)) for addr, n in runs)  # K of layers 0..L-1, then V
        assert flat == canonical[:, :, i].contiguous().numpy().tobytes()
        assert all(addr % 4096 == 0 and n % 4096 == 0 for addr, n in runs)  # O_DIRECT lands in place
    kv = kvstore.DeviceKV(TINY, torch.device("cpu"))
    plan = TINY.plan(4)
    for layers in host.load_chunks(plan):
        host.copy_layers(kv, layers)
    assert kv.matches(canonical.reshape(2, TINY.layers, -1))
    assert len(host.load_chunks(plan)) == (TINY.layers if layout == "layer_first" else 4)


def _flip(pool, key, offset: int) -> None:
    """Flip one byte at ``offset`` of ``key``'s slot in its segment file (as tests/store/test_parts does)."""
    store = pool.own
    slot = store.slot_of(key)
    arena = store.layout.arenas[slot % len(store.layout.arenas)]
    seg, index = divmod(slot // len(store.layout.arenas), arena.slots_per_segment)
    with open(arena.dir / f"seg-{seg:05d}.dat", "r+b") as f:
        f.seek(index * store.slot_bytes + offset)
        byte = f.read(1)[0]
        f.seek(index * store.slot_bytes + offset)
        f.write(bytes([byte ^ 0x5A]))


@pytest.fixture
def one_thread():
    """torch on one thread (busy cores stall its spin-waits), restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_a_failed_group_never_reaches_the_device(tmp_path: Path, one_thread: None) -> None:
    plan = TINY.plan(4)
    canonical = kvstore.canonical_pages(TINY)
    expected = canonical.reshape(2, TINY.layers, -1)
    host = kvstore.HostKV(TINY, "layer_first", pin=False)
    keys = kvstore.page_keys(TINY, TINY.pages)
    cpu = torch.device("cpu")
    model, kv, sync = StandIn(TINY, cpu, torch.float32), kvstore.DeviceKV(TINY, cpu), pipeline.Sync(cpu)
    with kvstore.open_pool(tmp_path, TINY, plan, "layer_first") as pool:
        host.fill(canonical)
        assert kvstore.write_pages(pool, keys, host) == TINY.pages
        host.zero()
        good = pipeline.streamed(pool, keys, host, kv, model, sync, plan)
        assert good.ok and kv.matches(expected) and len(good.group_landed_s) == 4
        assert good.group_landed_s == sorted(good.group_landed_s)  # group-major: group g before g + 1
        offset, _ = plan.part_range(1)  # K of layer group 1, page 2
        _flip(pool, keys[2], offset + 100)
        host.zero()
        kv.zero()
        bad = pipeline.streamed(pool, keys, host, kv, model, sync, plan)
        assert not bad.ok
        g0 = plan.layers(0)
        assert torch.equal(kv.data[:, g0.start:g0.stop], expected[:, g0.start:g0.stop])  # verified: copied
        assert not kv.data[:, plan.layers(1).start:].any()  # the failed group and later ones: zeros only
        assert pool.counters.parts_failed >= 1
    with kvstore.open_pool(tmp_path / "again", TINY, plan, "layer_first") as pool:
        host.fill(canonical)
        kvstore.write_pages(pool, keys, host)
        host.zero()
        kv.zero()
        whole = pipeline.load_all(pool, keys, host, kv, model, sync, plan)
        assert whole.ok and whole.read_s is not None and kv.matches(expected)


def test_cpu_check_runs_the_gpu_script(tmp_path: Path) -> None:
    out, threads = tmp_path / "out", torch.get_num_threads()
    rc = gpu_stream.main(["--cpu-check", "--groups", "1", "4", "--breakeven-gbps", "0.2", "--out", str(out),
                          "--dir", str(tmp_path / "scratch")])
    assert rc == 0
    result = json.loads((out / "gpu_stream.json").read_text())
    assert result["mode"].startswith("CPU check") and set(result["geometries"]) == set(GEOMETRIES)
    cells = result["cells"]
    assert len(cells) == len(GEOMETRIES) * 2 * 2 * 2  # geometries x layouts x G x devices
    assert {(c["layout"], c["device"], c["groups"]) for c in cells} == {
        (lay, dev, g) for lay in kvstore.LAYOUTS for dev in ("fast", "breakeven") for g in (1, 4)}
    for c in cells:
        assert not c.get("skipped") and c["ok"] and c["verified"], c
        assert set(c["median"]) == {"compute_s", "load_all_s", "read_s", "streamed_s", "waited_s", "h2d_s"}
        assert [len(x) for x in c["group_landed_s"]] == [c["groups"]]
    for name, be in result["breakeven"].items():
        assert be["read_bytes_per_s"] == 0.2e9 and be["source"].startswith("given"), name
    md = (out / "gpu_stream.md").read_text()
    assert "| geometry | layout | device | G |" in md and "| 480b-tp8 | page_first_direct | breakeven | 4 |" in md
    assert (out / "gpu_stream.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "scratch").exists()  # the stores are removed
    assert torch.get_num_threads() == threads  # the check's one thread is given back
