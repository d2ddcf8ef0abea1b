"""Measured inputs of the load-or-recompute policy, per SGLang process, and the switch that enables it.

The switch: ``KVTIER_PREFETCH_POLICY=cost`` in the server's environment (SGLang's spawned scheduler
processes inherit it). Unset, empty or ``off``: off. Any other value: off, with one warning. An environment
variable rather than a key of the extra-config JSON because SGLang runs ``load_plugins()`` (which decides
whether to hook anything) early in each process, before the scheduler builds the cache and our backend
parses the extra config.

Inputs:
- read path: each page store's ``read_rates`` (moving least squares over the real ``get`` batches);
- prefill speed: ``PREFILL``, fed by the plugin from SGLang's own per-batch timings (a batch's
  ``launch_ts`` to the end of its ``process_batch_result``), the first ``WARMUP_BATCHES`` extend batches
  skipped (compilation, warm-up request). Until it has enough samples it answers the seed from
  ``KVTIER_PREFILL_TOKENS_PER_S`` if set, else nothing (and the policy defers to SGLang's own).

Invariants: imports no sglang (callers hand SGLang objects' plain fields in); never raises into SGLang
(``shorten_hit`` answers the unshortened hit on any problem); with the switch off, nothing here changes
what the backend reports.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence

from sgl_kvtier.policy.cost_model import (DeviceModel, LoadProgress, PrefillEstimator, PrefillModel, RequestShape,
                                         plan, ttft)

log = logging.getLogger(__name__)

ENV_POLICY = "KVTIER_PREFETCH_POLICY"
ENV_PREFILL_TOKENS_PER_S = "KVTIER_PREFILL_TOKENS_PER_S"
WARMUP_BATCHES = 2
LOG_INTERVAL_S = 60.0

_warned: set[str] = set()
_lock = threading.Lock()
_batches_seen = 0
_last_log = -LOG_INTERVAL_S


def policy_enabled() -> bool:
    value = os.environ.get(ENV_POLICY, "").strip().lower()
    if value == "cost":
        return True
    if value not in ("", "off") and value not in _warned:
        _warned.add(value)
        log.warning("%s=%r is not a policy (use 'cost' or 'off'); the cost policy stays off", ENV_POLICY, value)
    return False


def _seed() -> PrefillModel | None:
    raw = os.environ.get(ENV_PREFILL_TOKENS_PER_S, "").strip()
    if not raw:
        return None
    try:
        return PrefillModel.from_tokens_per_s(float(raw))
    except ValueError:
        log.warning("%s=%r is not a positive number; ignored", ENV_PREFILL_TOKENS_PER_S, raw)
        return None


PREFILL = PrefillEstimator(seed=_seed())


def reset_prefill(seed: PrefillModel | None = None) -> PrefillEstimator:
    """A fresh estimator (tests; a re-calibration)."""
    global PREFILL, _batches_seen
    with _lock:
        PREFILL = PrefillEstimator(seed=seed)
        _batches_seen = 0
    return PREFILL


def record_prefill_batch(extend_lens: Sequence[int], prefix_lens: Sequence[int], seconds: float) -> bool:
    """One finished extend batch; False when it was skipped (warm-up, malformed)."""
    global _batches_seen
    if len(extend_lens) != len(prefix_lens) or not extend_lens:
        return False
    with _lock:
        _batches_seen += 1
        if _batches_seen <= WARMUP_BATCHES:
            return False
    PREFILL.record_batch(list(zip(extend_lens, prefix_lens)), seconds)
    return True


def prefill_model() -> PrefillModel | None:
    return PREFILL.model()


# ---------------------------------------------------------------------------------------------- backend side
def _kv_tier(backend: Any) -> Any:
    return getattr(backend, "kv", None)


def device_model(backend: Any) -> DeviceModel | None:
    """The measured read model of the backend's KV store, or None (not ours, not open, not measured)."""
    tier = _kv_tier(backend)
    store = getattr(tier, "store", None)
    rates = getattr(store, "read_rates", None)
    return None if rates is None else rates.model()


def page_geometry(backend: Any) -> tuple[int, int] | None:
    tier = _kv_tier(backend)
    pages = getattr(tier, "pages", None)
    return None if pages is None else (pages.page_tokens, pages.page_bytes)


def cost_inputs(backend: Any) -> dict:
    """Everything the policy measures, for logs and operators: JSON-ready."""
    out: dict = {"policy": "cost" if policy_enabled() else "off", "prefill": PREFILL.snapshot(), "pools": {}}
    for name, tier in dict(getattr(backend, "tiers", {})).items():
        store = getattr(tier, "store", None)
        rates = getattr(store, "read_rates", None)
        if rates is None:
            continue
        paths = [a.path for a in store.layout.arenas]
        out["pools"][name] = {
            "page_bytes": tier.pages.page_bytes, "read": rates.total.snapshot(),
            "devices": [{"path": p, **r.snapshot()} for p, r in zip(paths, rates.devices)]}
    return out


def maybe_log_inputs(backend: Any, now: float) -> None:
    """At most one INFO line of the measured inputs per ``LOG_INTERVAL_S``."""
    global _last_log
    with _lock:
        if now - _last_log < LOG_INTERVAL_S:
            return
        _last_log = now
    log.info("kvtier cost inputs: %s", cost_inputs(backend))


def shorten_hit(backend: Any, queried_pages: int, hit_pages: int, prefix_pages: int) -> int:
    """The hit worth loading: ``plan`` over the span ``batch_exists`` was asked about (``queried_pages``,
    after ``prefix_pages`` pages the tree already holds). The hit unchanged when the policy is off or
    an input is not measured yet."""
    if hit_pages <= 0 or not policy_enabled():
        return hit_pages
    try:
        geometry, device, prefill = page_geometry(backend), device_model(backend), prefill_model()
        if geometry is None or device is None or prefill is None:
            return hit_pages
        page_tokens, page_bytes = geometry
        shape = RequestShape(page_tokens, page_bytes, hit_pages, cached_tokens=prefix_pages * page_tokens,
                             tail_tokens=max(queried_pages - hit_pages, 0) * page_tokens)
        decision = plan(shape, device, prefill)
    except (ArithmeticError, ValueError, AttributeError) as exc:  # never into SGLang's prefetch thread
        log.warning("kvtier cost policy: hit kept, the model failed: %s: %s", type(exc).__name__, exc)
        return hit_pages
    if decision.load_pages < hit_pages:
        log.info("kvtier cost policy: reporting %d of %d hit pages (predicted TTFT %.3fs vs %.3fs all loaded)",
                 decision.load_pages, hit_pages, decision.ttft_s, _all_loaded(shape, device, prefill))
    return decision.load_pages


def _all_loaded(shape: RequestShape, device: DeviceModel, prefill: PrefillModel) -> float:
    return ttft(shape, LoadProgress(), device, prefill, shape.hit_pages)
