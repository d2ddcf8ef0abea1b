"""Punching holes over freed slots gives their blocks back to the filesystem, and never raises."""

from __future__ import annotations

import os
import sys

import pytest

from sgl_kvtier.store import holes

BLOCK = 4096


@pytest.fixture
def segment(tmp_path):
    """A preallocated 1 MiB file, as a segment is."""
    fd = os.open(tmp_path / "seg-00000.dat", os.O_RDWR | os.O_CREAT, 0o600)
    os.posix_fallocate(fd, 0, 256 * BLOCK)
    os.pwrite(fd, b"\xab" * (256 * BLOCK), 0)
    os.fsync(fd)
    yield fd
    os.close(fd)


def test_punch_frees_blocks_keeps_the_size_and_reads_zeros(segment):
    if not holes.supported():
        pytest.skip(f"no fallocate on {sys.platform}")
    before = os.fstat(segment)
    if not holes.punch(segment, 64 * BLOCK, 64 * BLOCK):
        pytest.skip("this filesystem does not punch holes (EOPNOTSUPP or similar)")
    after = os.fstat(segment)
    assert after.st_size == before.st_size
    if after.st_blocks >= before.st_blocks:
        pytest.skip(f"the filesystem accepted the punch but st_blocks stayed {after.st_blocks}")
    assert before.st_blocks - after.st_blocks >= 64 * BLOCK // 512 // 2
    assert os.pread(segment, 64 * BLOCK, 64 * BLOCK) == bytes(64 * BLOCK)
    assert os.pread(segment, BLOCK, 0) == b"\xab" * BLOCK and os.pread(segment, BLOCK, 128 * BLOCK) == b"\xab" * BLOCK
    # A later write into the hole allocates again.
    os.pwrite(segment, b"\xcd" * BLOCK, 64 * BLOCK)
    os.fsync(segment)
    assert os.fstat(segment).st_blocks > after.st_blocks
    assert os.pread(segment, BLOCK, 64 * BLOCK) == b"\xcd" * BLOCK


def test_punch_never_raises(tmp_path, segment):
    assert holes.punch(segment, 0, 0) is True
    assert holes.punch(segment, -1, BLOCK) is False
    assert holes.punch(segment, 0, -BLOCK) is False
    bad = os.open(tmp_path / "closed", os.O_RDWR | os.O_CREAT, 0o600)
    os.close(bad)
    assert holes.punch(bad, 0, BLOCK) is False  # EBADF
    ro = os.open(tmp_path / "closed", os.O_RDONLY)
    try:
        assert holes.punch(ro, 0, BLOCK) is False  # EBADF: not open for writing
    finally:
        os.close(ro)


def test_punch_reports_false_where_unsupported(monkeypatch, segment):
    monkeypatch.setattr(holes, "_loaded", True)
    monkeypatch.setattr(holes, "_fallocate", None)
    assert holes.punch(segment, 0, BLOCK) is False and not holes.supported()


def test_runs_coalesce_consecutive_slots():
    assert holes.runs([]) == []
    assert holes.runs([5, 3, 4, 9, 10, 3, 0]) == [(0, 1), (3, 3), (9, 2)]
