"""What ``bench_cluster``'s writers do, as plain data: where each writer runs, which pages it puts each round,
and which chains it looks up (pure functions; the driver sends them to ``pool_worker`` processes).

Writer ``w`` of ``n`` runs on host ``w % hosts`` (so 8 writers on 4 hosts are 2 per host) and puts ``pages``
new pages each round, one chain: key numbers ``w * KEY_SPAN + round * pages + j``. After the round's puts,
each writer looks up chains of ``lookup_pages`` pages, each the head of another writer's chain of this round
(the others in turn): first ``fresh`` ones, right after the puts (a page is visible to other hosts once its
writer's lease announced it), then, once every writer sees every other's pages of the round, ``settled``
ones. A writer alone looks up its own chains (``own``).
"""

from __future__ import annotations

from typing import Any

KEY_SPAN = 1_000_000  # key numbers of one writer: [w * KEY_SPAN, (w + 1) * KEY_SPAN)


def placement(writers: int, hosts: int) -> list[int]:
    """The host index of each of ``writers`` writers: round-robin over ``hosts``."""
    if writers < 1 or hosts < 1:
        raise ValueError(f"need at least one writer and one host, got {writers} and {hosts}")
    return [w % hosts for w in range(writers)]


def round_keys(writer: int, rnd: int, pages: int) -> list[int]:
    """The key numbers ``writer`` puts in round ``rnd`` (one chain, in order)."""
    if pages > KEY_SPAN // 1000:
        raise ValueError(f"at most {KEY_SPAN // 1000} pages a round, got {pages}")
    start = writer * KEY_SPAN + rnd * pages
    return list(range(start, start + pages))


def chains(writer: int, writers: int, rnd: int, lookups: int, pages: int, lookup_pages: int,
           kind: str) -> list[dict[str, Any]]:
    """The ``lookups`` chains ``writer`` looks up after round ``rnd``'s puts, as ``kind`` (``fresh`` or
    ``settled``): ``{"kind", "of", "keys"}`` each, ``of`` the writer whose pages they are (module docstring)."""
    if kind not in ("fresh", "settled"):
        raise ValueError(f"a lookup is fresh or settled, not {kind!r}")
    if not 1 <= lookup_pages <= pages:
        raise ValueError(f"a lookup asks 1..{pages} pages (a round's chain), got {lookup_pages}")
    others = [w for w in range(writers) if w != writer] or [writer]
    out = []
    for i in range(lookups):
        of = others[(i + writer + rnd) % len(others)]
        out.append({"kind": "own" if of == writer else kind, "of": of,
                    "keys": round_keys(of, rnd, pages)[:lookup_pages]})
    return out


def others_keys(writer: int, writers: int, rnd: int, pages: int) -> list[int]:
    """Every key number the other writers put in round ``rnd``: what ``writer`` must see for it to settle."""
    return [n for w in range(writers) if w != writer for n in round_keys(w, rnd, pages)]
