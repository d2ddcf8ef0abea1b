"""Device kinds: O_DIRECT fallback on a filesystem that refuses it, raw block devices (a regular file and
a real loop device), region tables shared by shards, and refusing a disk that holds foreign data."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from support import HostMemory, key, namespace, open_store

from sgl_kvtier.errors import DeviceError

PAGE = 16384


def round_trip(store, n=8, seed=0):
    mem = HostMemory(n, page_bytes=PAGE)
    expected = [mem.fill(i, seed + i) for i in range(n)]
    assert store.put([key(i) for i in range(n)], [mem.runs(i) for i in range(n)]) == [True] * n
    mem.clear()
    assert store.get([key(i) for i in range(n)], [mem.runs(i) for i in range(n)]) == [True] * n
    assert [mem.page(i).tobytes() for i in range(n)] == expected
    return expected


def _refuses_o_direct(directory: Path) -> bool:
    probe = directory / "probe"
    probe.write_bytes(b"x")
    try:
        os.close(os.open(probe, os.O_RDONLY | os.O_DIRECT))
        return False
    except OSError:
        return True
    finally:
        probe.unlink()


@pytest.fixture
def no_direct_dir(tmp_path):
    """A filesystem without O_DIRECT: /dev/shm on older kernels; ramfs (mounted here as root) on newer ones."""
    if os.path.isdir("/dev/shm"):
        d = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="kvtier-"))
        if _refuses_o_direct(d):
            yield d
            shutil.rmtree(d, ignore_errors=True)
            return
        shutil.rmtree(d, ignore_errors=True)
    d = tmp_path / "ramfs"
    d.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(d)], capture_output=True).returncode:
        pytest.skip("no filesystem without O_DIRECT available (tmpfs takes O_DIRECT on this kernel; ramfs needs root)")
    try:
        assert _refuses_o_direct(d)
        yield d
    finally:
        subprocess.run(["umount", str(d)], check=False)


def test_o_direct_falls_back_to_buffered(no_direct_dir, caplog):
    caplog.set_level(logging.WARNING, logger="sgl_kvtier")
    with open_store(no_direct_dir, page_bytes=PAGE) as store:
        assert store.layout.direct is False
        round_trip(store)
    assert any("refuses O_DIRECT" in r.message for r in caplog.records)
    with pytest.raises(DeviceError, match="O_DIRECT"):
        open_store(no_direct_dir, page_bytes=PAGE, direct_io="on", ns=namespace(PAGE, model="o"))


def test_o_direct_is_used_on_a_real_filesystem(tmp_path):
    with open_store(tmp_path, page_bytes=PAGE) as store:
        if not store.layout.direct:
            pytest.skip(f"{tmp_path} does not support O_DIRECT")
        round_trip(store)


def make_blockfile(path: Path, size: int) -> str:
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def test_regular_file_as_block_device_with_two_shards(tmp_path):
    dev = make_blockfile(tmp_path / "disk.img", 8 << 20)
    meta = tmp_path / "meta"
    meta.mkdir()
    a_ns, b_ns = namespace(PAGE, tp_rank=0, tp_size=2), namespace(PAGE, tp_rank=1, tp_size=2)
    with open_store(tmp_path, page_bytes=PAGE, devices=[dev], meta_dir=str(meta), capacity_bytes=None, ns=a_ns) as a, \
            open_store(tmp_path, page_bytes=PAGE, devices=[dev], meta_dir=str(meta), capacity_bytes=None, ns=b_ns) as b:
        expected_a = round_trip(a, seed=0)
        round_trip(b, seed=100)
        # Each shard got half the device (the default share is device / shard count), disjoint regions.
        assert a.stats().capacity_bytes == b.stats().capacity_bytes
        assert a.stats().capacity_bytes <= (8 << 20) // 2
        assert a.layout.arenas[0].offset != b.layout.arenas[0].offset
    mem = HostMemory(8, page_bytes=PAGE)
    with open_store(tmp_path, page_bytes=PAGE, devices=[dev], meta_dir=str(meta), capacity_bytes=None, ns=a_ns) as a:
        assert a.get([key(i) for i in range(8)], [mem.runs(i) for i in range(8)]) == [True] * 8
        assert [mem.page(i).tobytes() for i in range(8)] == expected_a


def test_block_device_needs_a_meta_dir(tmp_path):
    dev = make_blockfile(tmp_path / "disk.img", 4 << 20)
    with pytest.raises(DeviceError, match="meta_dir"):
        open_store(tmp_path, page_bytes=PAGE, devices=[dev])


def test_foreign_data_is_never_formatted_over(tmp_path):
    dev = tmp_path / "disk.img"
    make_blockfile(dev, 4 << 20)
    with open(dev, "r+b") as f:
        f.write(b"\x53\xef" * 100)  # something that is not ours
    with pytest.raises(DeviceError, match="not an sgl-kvtier store"):
        open_store(tmp_path, page_bytes=PAGE, devices=[str(dev)], meta_dir=str(tmp_path))
    assert open(dev, "rb").read(4) == b"\x53\xef\x53\xef"


def test_block_device_too_small(tmp_path):
    dev = make_blockfile(tmp_path / "tiny.img", (1 << 20) + 8192)  # header + less than one slot
    with pytest.raises(DeviceError, match="too small"):
        open_store(tmp_path, page_bytes=PAGE, devices=[dev], meta_dir=str(tmp_path), capacity_bytes=None)


@pytest.fixture
def loop_device(tmp_path):
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        pytest.skip("loop devices need root and losetup")
    backing = make_blockfile(tmp_path / "loop.img", 16 << 20)
    proc = subprocess.run(["losetup", "-f", "--show", "--direct-io=on", backing], capture_output=True, text=True)
    if proc.returncode:
        proc = subprocess.run(["losetup", "-f", "--show", backing], capture_output=True, text=True)
    if proc.returncode:
        pytest.skip(f"losetup is not permitted here: {proc.stderr.strip()}")
    dev = proc.stdout.strip()
    yield dev
    subprocess.run(["losetup", "-d", dev], check=False)


def test_real_loop_block_device_striped_with_a_directory(tmp_path, loop_device):
    assert Path(loop_device).is_block_device()
    d = tmp_path / "dir-dev"
    d.mkdir()
    cfg = dict(page_bytes=PAGE, devices=[str(d), loop_device], capacity_bytes=4 << 20)
    with open_store(tmp_path, **cfg) as store:
        assert store.layout.arenas[1].direct, "a block device takes O_DIRECT"
        expected = round_trip(store, n=16)
    mem = HostMemory(16, page_bytes=PAGE)
    with open_store(tmp_path, **cfg) as store:
        assert store.get([key(i) for i in range(16)], [mem.runs(i) for i in range(16)]) == [True] * 16
        assert [mem.page(i).tobytes() for i in range(16)] == expected
