"""The identity of a model's weights, from its files, for the namespace (``Namespace.model_fingerprint``).

``fingerprint_model(model_path, tokenizer_path, settings)`` is a SHA-256 (32 hex characters) over labelled,
length-prefixed parts: the config files; the tokenizer files (from the tokenizer path when local, else the
model's); the weight index (``*.index.json`` and the weight files with their sizes); sampled bytes of every
weight file (first and last ``EDGE_BYTES``; for safetensors also the header and the first bytes of up to
``TENSOR_SAMPLES`` tensors spread over the model, which a fine-tune changes), so even a large model costs a
few thousand small reads; and the non-``None`` ``settings`` that change the KV.

Invariants: the value depends only on file contents, relative names and ``settings`` (never absolute paths,
mtimes, host or process). It never raises: a model that is not local (an uncached hub id, a remote URI) or
unreadable is fingerprinted by name and ``settings`` (``source == "name"``, warned once); a locally cached hub
id by its snapshot, commit included. ``fingerprint_once`` caches per process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

log = logging.getLogger(__name__)

VERSION = "sgl-kvtier-model-fingerprint/1"
HEX_CHARS = 32
EDGE_BYTES = 64 * 1024  # read at the start and at the end of every weight file
TENSOR_BYTES = 256  # read at the start of each sampled safetensors tensor
TENSOR_SAMPLES = 4096  # sampled tensors per model, at most
HEADER_CAP = 256 * 1024 * 1024  # a larger safetensors header is not believed (the file is hashed as opaque)
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "hf_quant_config.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json")
TOKENIZER_SUFFIXES = (".model", ".tiktoken")
WEIGHT_SUFFIXES = ((".safetensors",), (".bin", ".pt", ".pth", ".gguf"))  # the first group found wins


@dataclass(frozen=True)
class Fingerprint:
    """A model's fingerprint and what it was computed from (``files``, ``hub-cache`` or ``name``)."""

    value: str
    source: str
    weight_files: int = 0

    @property
    def weights_known(self) -> bool:
        """Whether the weights' bytes went into the value (otherwise it names the model only)."""
        return self.source != "name"


class _Hasher:
    def __init__(self) -> None:
        self._h = hashlib.sha256(VERSION.encode())

    def part(self, label: str, data: bytes) -> None:
        tag = label.encode()
        self._h.update(len(tag).to_bytes(4, "little") + tag + len(data).to_bytes(8, "little"))
        self._h.update(data)

    def value(self) -> str:
        return self._h.hexdigest()[:HEX_CHARS]


def fingerprint_model(model_path: str | os.PathLike[str] | None, tokenizer_path: str | os.PathLike[str] | None = None,
                      settings: Mapping[str, object] | None = None) -> Fingerprint:
    """The fingerprint of the model at ``model_path`` (a directory, a weight file, or a hub id that is
    cached locally), or of its name where its files cannot be read; never raises."""
    known = {k: v for k, v in (settings or {}).items() if v is not None}
    name = "" if model_path is None else str(model_path)
    try:
        local, commit = resolve_local(name, _str_or_none(known.get("revision")))
        if local is not None:
            if commit is not None:
                known["resolved_commit"] = commit
            tok = resolve_local(str(tokenizer_path), None)[0] if tokenizer_path else None
            value, files = _from_files(local, tok if tok is not None and tok.is_dir() else None, known)
            return Fingerprint(value, "hub-cache" if commit is not None else "files", files)
    except (OSError, ValueError) as exc:
        log.warning("kvtier: cannot read the model files of %r (%s); fingerprinting its name only", name, exc)
    h = _Hasher()
    h.part("name", name.encode())
    h.part("settings", _settings_bytes(known))
    return Fingerprint(h.value(), "name")


@functools.lru_cache(maxsize=32)
def fingerprint_once(model_path: str | None, tokenizer_path: str | None = None,
                     settings: tuple[tuple[str, str], ...] = ()) -> Fingerprint:
    """``fingerprint_model`` computed once per process for the same arguments; the warning that weight
    identity is the name only is logged here, once."""
    fp = fingerprint_model(model_path, tokenizer_path, dict(settings))
    if not fp.weights_known:
        log.warning("kvtier: model %r is not a local directory or a cached hub snapshot: the weights' identity "
                    "in the L3 namespace is the model name only (same name, other weights would share KV); "
                    "set the model_fingerprint key to name the weights", model_path)
    return fp


def resolve_local(model_path: str, revision: str | None) -> tuple[Path | None, str | None]:
    """The local directory or file of ``model_path`` and, for a hub snapshot, its commit; (None, None) if
    it is neither a local path nor a hub id in the local Hugging Face cache."""
    if not model_path:
        return None, None
    path = Path(model_path).expanduser()
    if path.is_dir() or path.is_file():
        return path, None
    parts = model_path.split("/")
    if len(parts) > 2 or not all(parts) or any(p in (".", "..") for p in parts) or "://" in model_path:
        return None, None
    for cache in _hub_caches():
        repo = cache / ("models--" + "--".join(parts))
        commit = _commit(repo, revision or "main")
        if commit is not None and (repo / "snapshots" / commit).is_dir():
            return repo / "snapshots" / commit, commit
    return None, None


def _hub_caches() -> Iterator[Path]:
    env = os.environ
    for value in (env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE")):
        if value:
            yield Path(value).expanduser()
    yield Path(env.get("HF_HOME") or Path.home() / ".cache" / "huggingface").expanduser() / "hub"


def _commit(repo: Path, revision: str) -> str | None:
    if len(revision) == 40 and all(c in "0123456789abcdef" for c in revision):
        return revision
    if "/" in revision or revision in ("", ".", ".."):
        return None
    try:
        return (repo / "refs" / revision).read_text().strip() or None
    except OSError:
        return None


def _from_files(model: Path, tokenizer_dir: Path | None, settings: Mapping[str, object]) -> tuple[str, int]:
    h = _Hasher()
    if model.is_file():  # a single weight file (e.g. a GGUF): its name is not part of its identity
        weights = [("", model)]
    else:
        for name in CONFIG_FILES:
            if (model / name).is_file():
                h.part(f"config:{name}", (model / name).read_bytes())
        tok = tokenizer_dir or model
        for f in sorted(p for p in tok.iterdir() if p.is_file() and
                        (p.name in TOKENIZER_FILES or p.suffix in TOKENIZER_SUFFIXES)):
            h.part(f"tokenizer:{f.name}", f.read_bytes())
        for f in sorted(p for p in model.iterdir() if p.is_file() and p.name.endswith(".index.json")):
            h.part(f"index:{f.name}", f.read_bytes())
        weights = _weight_files(model)
    listing = [[name, path.stat().st_size] for name, path in weights]
    h.part("weights", json.dumps(listing).encode())
    _sample_weights(h, weights)
    h.part("settings", _settings_bytes(settings))
    return h.value(), len(weights)


def _weight_files(model: Path) -> list[tuple[str, Path]]:
    files = [p for p in model.iterdir() if p.is_file()]
    for suffixes in WEIGHT_SUFFIXES:
        found = sorted((p.name, p) for p in files if p.suffix in suffixes)
        if found:
            return found
    return []


def _sample_weights(h: _Hasher, weights: list[tuple[str, Path]]) -> None:
    tensors: list[tuple[int, int, int]] = []  # (weight file index, absolute offset, length)
    for i, (name, path) in enumerate(weights):
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            h.part(f"head:{name}", _pread(f, 0, EDGE_BYTES))
            h.part(f"tail:{name}", _pread(f, max(0, size - EDGE_BYTES), EDGE_BYTES))
            if path.suffix == ".safetensors":
                header = _safetensors_header(f, size)
                if header is not None:
                    h.part(f"header:{name}", header[0])
                    tensors += [(i, off, n) for off, n in header[1]]
    if not tensors:
        return
    count = min(len(tensors), TENSOR_SAMPLES)
    chosen = [tensors[k * len(tensors) // count] for k in range(count)]
    opened: dict[int, bytes] = {}
    for i in sorted({c[0] for c in chosen}):
        with weights[i][1].open("rb") as f:
            opened[i] = b"".join(_pread(f, off, min(n, TENSOR_BYTES)) for j, off, n in chosen if j == i)
    for i, data in opened.items():
        h.part(f"tensors:{weights[i][0]}", data)


def _safetensors_header(f: BinaryIO, size: int) -> tuple[bytes, list[tuple[int, int]]] | None:
    """The header bytes and each tensor's (absolute data offset, length) in offset order; None when the
    file does not parse as safetensors (it is then hashed by its edges only)."""
    raw = _pread(f, 0, 8)
    if len(raw) < 8:
        return None
    n = int.from_bytes(raw, "little")
    if n > min(HEADER_CAP, size - 8):
        return None
    header = _pread(f, 8, n)
    try:
        table = json.loads(header)
    except (UnicodeDecodeError, ValueError):
        return None
    if not isinstance(table, dict):
        return None
    spans = []
    for key, entry in table.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) and key != "__metadata__" else None
        if isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets):
            begin, end = offsets
            if 0 <= begin <= end and 8 + n + end <= size:
                spans.append((8 + n + begin, end - begin))
    return header, sorted(spans)


def _pread(f: BinaryIO, offset: int, length: int) -> bytes:
    return os.pread(f.fileno(), length, offset)


def _settings_bytes(settings: Mapping[str, object]) -> bytes:
    return json.dumps({k: str(v) for k, v in sorted(settings.items()) if v is not None}, sort_keys=True).encode()


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)
