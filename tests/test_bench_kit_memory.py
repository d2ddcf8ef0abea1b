"""benchmarks.kit_memory: one kit scenario per backend, each in its own pytest process (the ``file`` row through
the plugin's routing to SGLang's ``HiCacheFile``), with ``--late``: what only the cyclic collector freed."""

from __future__ import annotations

import pytest

pytest.importorskip("sglang")

from benchmarks import kit_memory  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # two child pytest runs of the kit


def test_both_backends_run_it_and_no_backend_is_left_to_the_collector(capsys: pytest.CaptureFixture[str]) -> None:
    kit_memory.main(["--late", "-k", "Test_FULL_ps4 and produced_by_one_cache"])
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()
            if line.startswith(("| kvtier", "| file"))}
    assert set(rows) == {"kvtier", "file"}
    for cells in rows.values():
        assert cells[3].startswith("1 passed") and float(cells[1]) > 0
    assert rows["kvtier"][5] == "0"  # KVTierStorage objects only the collector freed
    assert rows["file"][2] == "1.00x"
