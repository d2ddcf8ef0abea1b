"""Security properties that hold by construction; these tests keep them holding."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from support import HostMemory, open_store

from sgl_kvtier.errors import StoreLockedError
from sgl_kvtier.sharing.writers import host_id

PACKAGE = Path(__file__).resolve().parents[1] / "sgl_kvtier"


def test_no_pickle_anywhere():
    """Nothing we store or load is unpickled: all formats are msgpack / raw bytes with checksums."""
    banned = {"pickle", "cPickle", "dill", "marshal", "shelve"}
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, (ast.Import, ast.ImportFrom)) else []
            if isinstance(node, ast.ImportFrom) and node.module:
                names.append(node.module)
            for name in names:
                assert name.split(".")[0] not in banned, f"{path}: imports {name}"
        assert "torch.load(" not in path.read_text(), path


def test_keys_never_become_paths(tmp_path):
    """Page keys live only inside index records: whatever bytes a key holds, no file is named after it."""
    mem = HostMemory(2)
    hostile = [b"../../../../etc/passwd\0".ljust(32, b"/"), bytes(range(32))]
    with open_store(tmp_path) as store:
        assert store.put(hostile, [mem.runs(0), mem.runs(1)]) == [True, True]
        assert store.longest_prefix(hostile) == 2
    names = {p.name for p in tmp_path.rglob("*")}
    assert all("passwd" not in n and ".." not in n for n in names)
    assert not Path("/etc/passwd\0").exists()
    assert {n for n in names if not n.startswith(("ns-", "w-"))} <= {
        "HEADER", "LOCK", "LEASE", "CONFIG", "checkpoint.bin", "seg-00000.dat"} | {n for n in names if n.startswith("journal-")}
    assert {n for n in names if n.startswith("w-")} == {f"w-{host_id(store.config)}-0"}


def test_second_writer_process_is_refused(tmp_path):
    """Under ``sharing = "off"``, two processes opening one shard for writing: the second gets a clear error
    naming the holder (with the default ``host`` it becomes a second writer: tests/sharing/test_sharing.py)."""
    with open_store(tmp_path, sharing="off"):
        code = textwrap.dedent(f"""
            import sys
            sys.path[:0] = {[str(Path(__file__).parent)]!r}
            from support import open_store
            from sgl_kvtier.errors import StoreLockedError
            try:
                open_store({str(tmp_path)!r}, sharing="off")
            except StoreLockedError as exc:
                print("refused:", exc)
                sys.exit(3)
        """)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "already open for writing by pid" in proc.stdout and "one writer process per namespace shard" in proc.stdout
    with pytest.raises(StoreLockedError):
        with open_store(tmp_path, sharing="off"):
            open_store(tmp_path, sharing="off")
    open_store(tmp_path, sharing="off").close()  # usable again once the holder closes
