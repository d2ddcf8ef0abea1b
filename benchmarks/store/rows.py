"""bench_store's table rows: one value per round, shown as medians, judged against fio or a fixed target."""

from __future__ import annotations

from dataclasses import dataclass, field

from benchmarks.common import median
from benchmarks.store.context import Ctx
from sgl_kvtier.config import MiB


@dataclass
class Row:
    """One table row; ``samples``/``baselines`` hold one value per round and the row shows their medians."""

    metric: str
    unit: str
    samples: list[float | None]
    baselines: list[float] = field(default_factory=list)  # fio, same unit
    min_ratio: float | None = None  # target: value >= min_ratio x baseline
    max_value: float | None = None  # target: value <= max_value
    max_ratio: float | None = None  # target: value <= max_ratio x baseline (a latency)
    note: str = ""

    value = property(lambda self: median(self.samples))
    baseline = property(lambda self: median(self.baselines))
    ratio = property(lambda self: self.value / self.baseline if self.value is not None and self.baseline else None)

    @property
    def target(self) -> str:
        if self.min_ratio is not None:
            return f">= {self.min_ratio:g}x fio"
        if self.max_ratio is not None:
            return f"<= {self.max_ratio:g}x fio"
        return "" if self.max_value is None else f"<= {self.max_value:g} {self.unit}"

    @property
    def passed(self) -> bool | None:
        if self.min_ratio is not None and self.ratio is not None:
            return self.ratio >= self.min_ratio
        if self.max_ratio is not None and self.ratio is not None:
            return self.ratio <= self.max_ratio
        return None if self.max_value is None or self.value is None else self.value <= self.max_value


def ratio_rows(ctx: Ctx, name: str, page_bytes: int, put: float | None, get: float | None, note: str = "") -> list[Row]:
    """Put/get rows (GB/s) of one system at one page size, judged against this round's fio write/read."""
    fio, get_op = ctx.fio[page_bytes], "get cold" if ctx.cold else "get WARM"
    return [Row(f"{name} {op} {page_bytes / MiB:g} MiB", "GB/s", [value], [fio[rw]], need, note=note)
            for op, value, rw, need in (("put", put, "write", 0.85), (get_op, get, "read", 0.9))]


def latency_row(ctx: Ctx, name: str, page_bytes: int, pages: int, ms: float, note: str = "") -> Row:
    """The ms of one ``pages``-page get, judged against the time fio's read (this round, same block size and
    queue depth) takes to move as many bytes: ``pages * page_bytes / fio read bandwidth``."""
    fio_ms = pages * page_bytes / (ctx.fio[page_bytes]["read"] * 1e9) * 1e3
    return Row(f"{name} get {pages} pages latency {page_bytes / MiB:g} MiB", "ms", [ms], [fio_ms], max_ratio=1.2,
               note=note)


def merge(rows: dict[str, Row], new: list[Row]) -> None:
    """Fold one round's rows into the table, keyed by metric."""
    for row in new:
        old = rows.setdefault(row.metric, row)
        if old is not row:
            old.samples, old.baselines, old.note = old.samples + row.samples, old.baselines + row.baselines, row.note
