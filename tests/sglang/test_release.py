"""The supported SGLang range (``sgl_kvtier.sglang.release``): stated once, checked at start-up, and the
adapter's differences between the releases. Runs on every supported release (``test_sglang_range``)."""

from __future__ import annotations

import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

pytest.importorskip("sglang")

from pools import mha_host_pool, storage_config  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from sgl_kvtier import __version__  # noqa: E402
from sgl_kvtier.sglang import KVTierStorage, release  # noqa: E402
from sgl_kvtier.sglang.release import UnsupportedSGLangError  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def test_the_range_is_stated_once_in_metadata_and_readme() -> None:
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang>={release.SUPPORTED[0]},<={release.SUPPORTED[-1]}"]
    readme = (ROOT / "README.md").read_text()
    assert f"SGLang {release.supported_range()}" in readme


@pytest.mark.parametrize("version, rel", [("0.5.23", "0.5.23"), ("0.5.22.post1", "0.5.22"), ("0.5.23rc0", "0.5.23"),
                                          ("0.5.23+cpu", "0.5.23"), ("1.0.0", "1.0.0")])
def test_release_of(version: str, rel: str) -> None:
    assert release.release_of(version) == rel


def test_every_supported_release_passes_and_others_are_refused_naming_both() -> None:
    for rel in release.SUPPORTED:
        assert release.check_supported(rel) == rel
        assert release.check_supported(rel + ".post2") == rel
    for found in ("0.5.21", "0.5.24", "0.4.10", "main"):
        with pytest.raises(UnsupportedSGLangError) as info:
            release.check_supported(found)
        assert str(info.value).startswith(f"SGLang {found} is installed; sgl-kvtier {__version__} supports SGLang "
                                          f"{release.SUPPORTED[0]} to {release.SUPPORTED[-1]}")


def test_the_installed_sglang_is_supported() -> None:
    assert release.check_supported() == release.release_of(release.installed() or "")


def test_an_unsupported_sglang_stops_start_up_in_sglangs_own_factory(tmp_path, monkeypatch) -> None:
    """SGLang's dynamic factory (what a server runs at start-up) raises our one message: no backend, nothing
    opened on the device."""
    monkeypatch.setattr(release, "installed", lambda: "0.5.21")
    extra = {"backend_name": "kvtier", "module_path": "sgl_kvtier.sglang", "class_name": "KVTierStorage",
             "interface_v1": 1, "devices": [str(tmp_path)], "capacity_bytes": 64 << 20}
    with pytest.raises(UnsupportedSGLangError, match=r"^SGLang 0\.5\.21 is installed; sgl-kvtier .* supports SGLang "):
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), mha_host_pool("page_first"))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("mla, tp_rank, writes", [(False, 0, True), (False, 3, True), (True, 0, True), (True, 1, False)])
def test_the_writer_is_sglangs_election_on_either_release(mla: bool, tp_rank: int, writes: bool) -> None:
    """0.5.23's ``is_storage_writer`` where it exists; 0.5.22's rule (the same with DCP off) where not."""
    cfg = storage_config({"devices": ["/x"]}, mla=mla, tp_rank=tp_rank, tp_size=4)
    assert release.writer_of(cfg) is writes
    old = SimpleNamespace(is_mla_model=mla, tp_rank=tp_rank)  # a 0.5.22 config: no property
    assert release.writer_of(old) is writes
    if hasattr(type(cfg), "is_storage_writer"):
        assert cfg.is_storage_writer is writes


def test_a_devices_string_names_the_field_at_the_adapter(tmp_path) -> None:
    from sgl_kvtier.errors import ConfigError

    with pytest.raises(ConfigError, match=r"^devices: expected a list of paths, got the string 'not-a-list'"):
        KVTierStorage(storage_config({"devices": "not-a-list"}))
    backend = KVTierStorage(storage_config({"devices": [str(tmp_path / "missing")]}))
    with pytest.raises(Exception, match=rf"^devices: {tmp_path / 'missing'} does not exist"):
        backend.register_mem_pool_host(mha_host_pool("page_first"))
    backend.close()
