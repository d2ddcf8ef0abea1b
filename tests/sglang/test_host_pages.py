"""``host_pages``: every zero-copy pool's page runs come from one page's runs shifted (``RunTemplate``),
equal to what SGLang's ``get_page_buffer_meta`` says for any pages, on every MHA and MLA layout; a pool
whose pages are not one page shifted keeps asking SGLang."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

import torch  # noqa: E402
from pools import MHA_LAYOUTS, mha_host_pool, mla_host_pool  # noqa: E402

from sgl_kvtier.sglang.host_pages import Access, HostPages, RunTemplate  # noqa: E402

PS = 16
POOLS = [("mha", layout) for layout in MHA_LAYOUTS] + [("mla", "page_first"), ("mla", "page_first_direct"),
                                                        ("mla", "layer_first")]


def pool_of(kind: str, layout: str):
    return mha_host_pool(layout, layers=4) if kind == "mha" else mla_host_pool(layout, layers=4)


def slots(pages: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(p * PS, (p + 1) * PS, dtype=torch.int64) for p in pages])


@pytest.mark.parametrize(("kind", "layout"), POOLS)
def test_page_runs_from_the_template_are_sglangs_for_any_pages(kind: str, layout: str) -> None:
    pages = HostPages.of(pool_of(kind, layout))
    assert pages.access is Access.ZERO_COPY and pages.template is not None
    last = pages.pool.size // PS - 1
    for picked in ([1, 2, 3], [last, 7, 1, 40], [last]):  # scattered, out of order, the pool's last page
        assert pages.page_runs(slots(picked)) == pages._meta_runs(slots(picked))
    assert sum(n for _, n in pages.template.runs) == pages.page_bytes


def test_a_pool_whose_pages_are_not_one_page_shifted_has_no_template() -> None:
    def affine(i: int) -> list[tuple[int, int]]:
        return [(4096 + i * 512, 256), (1 << 20 | i * 512, 256)]

    template = RunTemplate.of(affine, 100, PS)
    assert template is not None and template.stride == 512 and template.page(5 * PS) == affine(5)

    def kinked(i: int) -> list[tuple[int, int]]:  # runs of pages past 50 live elsewhere
        return affine(i) if i < 50 else [(a + (1 << 30), n) for a, n in affine(i)]

    def uneven(i: int) -> list[tuple[int, int]]:  # the second run moves at another stride
        return [(4096 + i * 512, 256), (1 << 20 | i * 1024, 256)]

    assert RunTemplate.of(kinked, 100, PS) is None and RunTemplate.of(uneven, 100, PS) is None
    assert RunTemplate.of(affine, 1, PS) is None  # one page: no stride to find
