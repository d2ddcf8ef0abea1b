"""Hypothesis state machines: the store against a dict model, across puts, gets, deletes, reopens and eviction."""

from __future__ import annotations

import shutil
import tempfile

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from support import HostMemory, key, open_store

PAGE = 8192
UNIVERSE = 24
keys_st = st.lists(st.integers(0, UNIVERSE - 1), min_size=1, max_size=8)


class StoreMachine(RuleBasedStateMachine):
    capacity = UNIVERSE  # no eviction: the model is exact
    eviction = "lru"

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="kvtier-model-")
        self.mem = HostMemory(8, page_bytes=PAGE)
        # key -> the byte strings it may hold. Usually one; two when a put offered new bytes for a stored key
        # (skipped) while the same put's evictions may have dropped and re-stored it. A get narrows it down.
        self.model: dict[int, set[bytes]] = {}
        self.version = 0
        self.store = self._open()

    def _open(self):
        return open_store(self.dir, capacity_pages=self.capacity, page_bytes=PAGE, eviction=self.eviction,
                          checkpoint_interval=7)

    @rule(ns=keys_st)
    def put(self, ns):
        batch = list(dict.fromkeys(ns))
        present_before = {n: self.store.contains(key(n)) for n in batch}
        written = {}
        for j, n in enumerate(batch):
            self.version += 1
            written[n] = self.mem.fill(j, self.version)
        ok = self.store.put([key(n) for n in batch], [self.mem.runs(j) for j in range(len(batch))])
        assert ok == [True] * len(batch)
        for n in batch:
            if present_before[n]:  # skipped (keeps its bytes), unless this put evicted it first
                self.model[n] = self.model[n] | {written[n]} if self.capacity < UNIVERSE else self.model[n]
            else:
                self.model[n] = {written[n]}
        self._sync_evictions()

    def _sync_evictions(self):
        for n in list(self.model):
            if not self.store.contains(key(n)):
                assert self.capacity < UNIVERSE, f"page {n} vanished without eviction"
                del self.model[n]

    @rule(ns=keys_st)
    def get(self, ns):
        batch = ns[:8]
        self.mem.clear()
        ok = self.store.get([key(n) for n in batch], [self.mem.runs(j) for j in range(len(batch))])
        for j, n in enumerate(batch):
            assert ok[j] == (n in self.model)
            if ok[j]:
                data = self.mem.page(j).tobytes()
                assert data in self.model[n]
                self.model[n] = {data}

    @rule(ns=keys_st)
    def delete(self, ns):
        self.store.delete([key(n) for n in ns])
        for n in ns:
            self.model.pop(n, None)

    @rule()
    def reopen(self):
        self.store.close()
        self.store = self._open()

    @precondition(lambda self: self.model)
    @rule()
    def prefix(self):
        order = sorted(self.model) + [n for n in range(UNIVERSE) if n not in self.model]
        assert self.store.longest_prefix([key(n) for n in order]) == len(self.model)

    @invariant()
    def same_size(self):
        assert len(self.store) == len(self.model)
        assert len(self.store) <= self.capacity

    def teardown(self):
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class EvictingStoreMachine(StoreMachine):
    capacity = 10
    eviction = "chain"


TestStoreModel = StoreMachine.TestCase
TestStoreModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                   suppress_health_check=[HealthCheck.too_slow])
TestEvictingStoreModel = EvictingStoreMachine.TestCase
TestEvictingStoreModel.settings = settings(max_examples=30, stateful_step_count=20, deadline=None,
                                           suppress_health_check=[HealthCheck.too_slow])
