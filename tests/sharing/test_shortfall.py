"""A lookup that falls short re-reads the other writers before it answers (``sharing.shortfall``): a retry
always, so it sees what another writer committed since its miss; any other at most every quarter of
``follow_interval_s``. One rule for a pool's peers (``sharing = "host"`` and ``"cluster"``), a ``SoleShard``
reader, ``longest_prefix`` and ``present`` alike.

The pools here follow with ``follow_interval_s`` = 600: no periodic refresh and no quarter interval passes
during a test, so whatever a lookup sees it saw through the shortfall rule. The rule's clock is driven where
time matters. No sleeps.
"""

from __future__ import annotations

import threading
from pathlib import Path

from support import HostMemory, key, namespace, store_config
from test_announced import PAGE, Pages, beat, cluster_config

from sgl_kvtier.sharing.pool import SharedPool
from sgl_kvtier.sharing.shortfall import Shortfalls
from sgl_kvtier.sharing.sole import SoleShard

SLOW = 600.0  # follow_interval_s: a quarter of it never passes in a test
NS = namespace(PAGE)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def host(path: Path, **extra):
    return store_config(path, 64, PAGE, heartbeat_s=600.0, follow_interval_s=SLOW, **extra)


def keys(*numbers: int) -> list:
    return [key(n) for n in numbers]


# ---------------------------------------------------------------------- the rule
def test_a_retry_is_due_at_once_and_any_other_lookup_at_most_every_quarter_interval():
    clock = Clock()
    rule = Shortfalls(8.0, clock)
    assert rule.due(keys(1, 2))  # the first: nothing refreshed yet
    assert not rule.due(keys(3, 4))  # another lookup within 2 s (8 / 4): the view is fresh enough
    assert rule.due(keys(1, 2)) and rule.due(keys(3, 4))  # retries: at once, however recent the last refresh
    assert rule.due(keys(9, 2))  # named by the last key asked: the same span from another start is a retry
    clock.t += 1.9
    assert not rule.due(keys(5))
    clock.t += 0.1
    assert rule.due(keys(6)) and not rule.due(keys(7))  # a quarter interval on: due again, once
    assert not rule.due([])  # nothing asked: never a retry


def test_only_the_last_lookups_answered_short_are_known_as_retries():
    clock = Clock()
    rule = Shortfalls(8.0, clock, remembered=2)
    assert rule.due(keys(1))
    assert not rule.due(keys(2)) and not rule.due(keys(3))  # 1 is forgotten: 2 and 3 are kept
    assert not rule.due(keys(1))  # no longer known as a retry (and remembered again)
    assert rule.due(keys(3))
    clock.t += 2.0
    assert rule.due(keys(4))


# ---------------------------------------------------------------------- a pool's peers, one host
def test_a_retry_sees_what_another_writer_committed_since_its_miss(tmp_path):
    pages = Pages()
    with SharedPool.open_writer(host(tmp_path), NS) as a, SharedPool.open_writer(host(tmp_path), NS) as b:
        assert b.longest_prefix(keys(1, 2)) == 0  # the miss: nothing there
        pages.put(a, [1, 2, 3, 4])
        assert b.longest_prefix(keys(3, 4)) == 0  # a first lookup right after a refresh: the view as it was
        assert b.longest_prefix(keys(1, 2)) == 2  # the retry re-reads a's journal first
        assert b.longest_prefix(keys(3, 4)) == 2 and pages.hits(b, [1, 2, 3, 4]) == [1, 2, 3, 4]
        pages.put(a, [5])
        assert b.longest_prefix(keys(3, 4, 5)) == 2  # a new lookup (its last key never asked): not re-read
        assert b.longest_prefix(keys(3, 4, 5)) == 3  # asked again: a retry


def test_a_writer_that_joins_after_the_miss_is_found_by_the_retry(tmp_path):
    pages = Pages()
    with SharedPool.open_writer(host(tmp_path), NS) as b:
        assert b.longest_prefix(keys(1)) == 0 and b.peers() == {}
        with SharedPool.open_writer(host(tmp_path), NS) as a:
            pages.put(a, [1])
            assert b.longest_prefix(keys(1)) == 1 and set(b.peers()) == {a.wid}


def test_present_and_shortfall_follow_the_same_rule(tmp_path):
    """The side pools' query (``present``): its caller decides it fell short and calls ``shortfall``."""
    pages = Pages()
    with SharedPool.open_writer(host(tmp_path), NS) as a, SharedPool.open_writer(host(tmp_path), NS) as b:
        asked = keys(1, 2)
        assert b.present(asked) == [False, False]
        assert b.shortfall(asked) is False  # due (the first), but nothing changed
        pages.put(a, [1, 2])
        assert b.present(asked) == [False, False]  # no refresh without a shortfall (follow_interval_s: 600)
        assert b.shortfall(keys(7)) is False  # another lookup: a quarter interval has not passed
        assert b.present(asked) == [False, False]
        assert b.shortfall(asked) is True  # the retry: a's pages are read
        assert b.present(asked) == [True, True]


def test_a_retry_waits_for_a_refresh_in_flight_elsewhere_then_runs_its_own(tmp_path, monkeypatch):
    """A refresh another thread began before the commit cannot answer the retry: it waits for that one to end
    (up to SHORTFALL_WAIT_S) and re-reads the journals itself."""
    pages = Pages()
    with SharedPool.open_writer(host(tmp_path), NS) as a, SharedPool.open_writer(host(tmp_path), NS) as b:
        pages.put(a, [1])
        assert b.longest_prefix(keys(1, 2)) == 1  # the miss (of 2); a is followed from here on
        peer = b.peers()[a.wid]
        replayed, commit_done = threading.Event(), threading.Event()
        real = peer.refresh

        def slow_refresh() -> bool:  # the other thread's refresh: replays, then stalls till the commit is made
            changed = real()
            if threading.current_thread().name == "other":
                replayed.set()
                assert commit_done.wait(10)
            return changed

        monkeypatch.setattr(peer, "refresh", slow_refresh)
        other = threading.Thread(target=lambda: b.refresh(force=True), name="other")
        other.start()
        assert replayed.wait(10)
        pages.put(a, [2])  # committed after the other thread's refresh read the journal
        answer: list[int] = []
        retry = threading.Thread(target=lambda: answer.append(b.longest_prefix(keys(1, 2))), name="retry")
        retry.start()
        commit_done.set()
        other.join(10)
        retry.join(10)
        assert answer == [2]


# ---------------------------------------------------------------------- across hosts, and a sole reader
def test_a_retry_sees_what_a_writer_of_another_host_announced_since_its_miss(tmp_path):
    """``sharing = "cluster"``: another host's commits are what its lease announced; the retry reads it."""
    pages = Pages()
    with SharedPool.open_writer(cluster_config(tmp_path, "ha", follow_interval_s=SLOW), NS) as a, \
            SharedPool.open_writer(cluster_config(tmp_path, "hb", follow_interval_s=SLOW), NS) as b:
        assert b.longest_prefix(keys(1, 2)) == 0
        pages.put(a, [1, 2])
        beat(a)  # announced: the journal synced and named in a's lease
        assert b.longest_prefix(keys(3)) == 0  # not a retry, within the quarter interval
        assert b.longest_prefix(keys(1, 2)) == 2 and pages.hits(b, [1, 2]) == [1, 2]


def test_a_sole_shards_reader_retry_sees_what_its_writer_committed_since(tmp_path):
    mem = HostMemory(1, PAGE)
    config = store_config(tmp_path, 64, PAGE, sharing="off", host_id="h", follow_interval_s=SLOW)
    with SoleShard.open_writer(config, NS) as writer, SoleShard.open_reader(config, NS) as reader:
        assert reader.longest_prefix(keys(1)) == 0 and reader.present(keys(1)) == [False]
        mem.fill(0, 1)
        assert writer.put(keys(1), [mem.runs(0)]) == [True]
        assert reader.longest_prefix(keys(2)) == 0  # a first lookup within the quarter interval
        assert reader.present(keys(1)) == [False]
        assert reader.shortfall(keys(1)) is True and reader.present(keys(1)) == [True]
        mem.fill(0, 2)
        assert writer.put(keys(2), [mem.runs(0)]) == [True]
        assert reader.longest_prefix(keys(2)) == 1  # the retry of the lookup above
        assert writer.shortfall(keys(3)) is False  # a writer's view is its own: nothing to re-read
