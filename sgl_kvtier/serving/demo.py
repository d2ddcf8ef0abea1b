"""``sgl-kvtier demo``: the README's main job, on an embedded default (CPU, tiny model, local directory).

1. A real SGLang server with sgl-kvtier as L3 answers a multi-turn conversation (each prompt's prefix is
   the previous prompt: device-cache hits).
2. ``/flush_cache`` empties HBM and host DRAM ("flushed") and the conversation is asked again: the prefix
   comes from flash (storage hits), with the same greedy answers.
3. A new server on the same store ("restarted"): hits come from flash again.
A table shows, per request, its cached prompt tokens by tier (device = HBM, host = DRAM, flash =
sgl-kvtier) and its TTFT.
"""

from __future__ import annotations

import json
import shutil
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from sgl_kvtier.serving.hardware import choose_dtype, has_cuda_gpu
from sgl_kvtier.serving.launch import sglang_args
from sgl_kvtier.serving.model_factory import make_prompt
from sgl_kvtier.serving.server import SGLangServer

# The embedded default; configs/cpu-demo.toml says the same (a test keeps them equal).
DEMO_CONFIG: dict[str, Any] = {
    "sglang": {
        "model_path": "tiny", "page_size": 16, "hicache_mem_layout": "layer_first", "hicache_io_backend": "direct",
        "hicache_ratio": 2, "max_total_tokens": 16384, "hicache_storage_prefetch_policy": "timeout",
        "prefetch_threshold": 64,
        "enable_cache_report": True, "enable_metrics": True, "log_level": "warning",
    },
    "kvtier": {"devices": ["./.kvtier-demo"], "capacity_bytes": 2_000_000_000, "durability": "batch",
               "eviction": "chain"},
}
SYSTEM_TOKENS, TURN_TOKENS = 640, 160


@dataclass(frozen=True)
class Row:
    """One request of the demo: its phase and turn, cached tokens per tier, TTFT and output."""

    phase: str
    turn: int
    prompt_tokens: int
    device: int
    host: int
    storage: int
    ttft_ms: float
    output: str


def stream_ttft(url: str, text: str, max_new_tokens: int) -> tuple[float, dict[str, Any]]:
    """POST a streamed /generate; (seconds to the first chunk, the final chunk's JSON)."""
    body = json.dumps({"text": text, "stream": True,
                       "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0.0}}).encode()
    req = urllib.request.Request(url + "/generate", data=body, method="POST",
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, last = None, None
    with urllib.request.urlopen(req, timeout=600) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:") or line == "data: [DONE]":
                continue
            first = first if first is not None else time.perf_counter() - t0
            last = json.loads(line[5:])
    if last is None or first is None:
        raise RuntimeError("the server streamed no tokens")
    return first, last


def conversation(model: Path, turns: int) -> list[str]:
    """Prompts of one growing chat: a shared system prompt, then each turn appends a question."""
    history = make_prompt(SYSTEM_TOKENS, seed=1, model_dir=model)
    prompts = []
    for turn in range(turns):
        history += " " + make_prompt(TURN_TOKENS, seed=100 + turn, model_dir=model)
        prompts.append(history)
    return prompts


def ask_all(srv: SGLangServer, phase: str, prompts: list[str], rows: list[Row], first_turn: int = 1) -> None:
    """Send ``prompts`` in order and append a ``Row`` for each."""
    for turn, prompt in enumerate(prompts, first_turn):
        ttft, out = stream_ttft(srv.url, prompt, max_new_tokens=8)
        meta = out["meta_info"]
        details = meta.get("cached_tokens_details") or {}
        rows.append(Row(phase, turn, meta["prompt_tokens"], details.get("device", 0), details.get("host", 0),
                        details.get("storage", 0), ttft * 1e3, out["text"]))


def server_args(device: Path, gpu: bool) -> tuple[Path, list[str]]:
    """The model path (made now, in the machine's native dtype unless ``KVTIER_MODEL_DTYPE`` says otherwise)
    and server flags of the demo config, with ``device`` as the flash device."""
    doc = json.loads(json.dumps(DEMO_CONFIG))
    doc["kvtier"]["devices"] = [str(device)]
    model, args, _ = sglang_args(doc, gpu=gpu)  # SGLangServer adds the CPU route itself
    return Path(model), [*args, "--skip-server-warmup"]


def render(rows: list[Row], console: Console) -> None:
    """Print the table of cached tokens per tier and TTFT."""
    table = Table(title="sgl-kvtier demo: cached tokens by tier and TTFT, per request")
    for col in ("phase", "turn", "prompt", "device", "host", "flash", "TTFT ms", "same out"):
        table.add_column(col, justify="right" if col not in ("phase", "same out") else "left")
    first_answers = {r.turn: r.output for r in rows if r.phase == rows[0].phase}
    for r in rows:
        table.add_row(r.phase, str(r.turn), str(r.prompt_tokens), str(r.device), str(r.host), str(r.storage),
                      f"{r.ttft_ms:.0f}", "yes" if r.output == first_answers.get(r.turn) else "NO")
    console.print(table)


def run(directory: Path, turns: int, console: Console) -> list[Row]:
    """Cold conversation, again after ``/flush_cache``, then the last turn after a restart; every row."""
    gpu = has_cuda_gpu()
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True, mode=0o700)
    with console.status("making the tiny random model (once per dtype)..."):
        model_path, args = server_args(directory, gpu)
    dtype = args[args.index("--dtype") + 1]
    console.print(f"model {model_path}: dtype {dtype} ({choose_dtype(DEMO_CONFIG['sglang'].get('dtype'), gpu=gpu).describe()})",
                  markup=False, highlight=False)
    prompts = conversation(model_path, turns)
    rows: list[Row] = []
    logs = directory.parent / (directory.name + "-logs")
    logs.mkdir(exist_ok=True)
    srv = SGLangServer(model_path, extra_args=args, log_path=logs / "server-1.log")
    try:
        with console.status("starting SGLang (about 45 s on CPU)..."):
            srv.start()
        with console.status("conversation, cold"):
            ask_all(srv, "cold", prompts, rows)
        expected = (rows[-1].prompt_tokens - 1) // 16 * 16
        with console.status("waiting for the pages to reach flash, then flushing HBM and DRAM"):
            srv.wait_metric("sglang:backuped_tokens_total", expected, timeout_s=180)
            srv.flush_cache()
        with console.status("conversation again, after /flush_cache"):
            ask_all(srv, "flushed", prompts, rows)
    finally:
        srv.stop()
    srv = SGLangServer(model_path, extra_args=args, log_path=logs / "server-2.log")
    try:
        with console.status("restarting SGLang on the same store..."):
            srv.start()
        with console.status("conversation again, after a restart"):
            ask_all(srv, "restarted", prompts[-1:], rows, first_turn=len(prompts))
    finally:
        srv.stop()
    return rows


def main(directory: str = ".kvtier-demo", turns: int = 3) -> int:
    """``sgl-kvtier demo``: 0 when flash served hits and every answer matched the cold one."""
    console = Console()
    rows = run(Path(directory).resolve(), turns, console)
    render(rows, console)
    from sgl_kvtier.admin.fsck import find_shards, shard_summary

    for shard in find_shards(str(Path(directory).resolve())):
        s = shard_summary(shard)
        console.print(f"store {s['meta']}: {s['pages']} pages, {s['bytes_used'] / 1e6:.1f} MB used, "
                      f"O_DIRECT={'yes' if s['direct_io'] else 'no'}")
    flash_hits = [r for r in rows if r.phase != "cold" and r.storage > 0]
    return 0 if flash_hits and all(r.output == rows[r.turn - 1].output for r in rows) else 1
