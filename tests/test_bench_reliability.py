"""benchmarks.reliability: a few rounds of each suite (the long runs are by hand)."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import reliability


def test_crash_suite_few_kills(tmp_path: Path) -> None:
    assert reliability.main(["crash", "--kills", "2", "--dir", str(tmp_path / "d"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "reliability_crash.json").read_text())
    assert result["kills"] == 2 and result["wrong_bytes"] == 0 and result["acked_pages_lost"] == 0
    assert result["pages_checked"] > 0 and result["acked_pages"] > 0 and result["machine"]["model_dtype"] is None
    assert not (tmp_path / "d").exists()


def test_corrupt_suite_few_faults(tmp_path: Path) -> None:
    assert reliability.main(["corrupt", "--faults", "20", "--dir", str(tmp_path / "d"), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "reliability_corrupt.json").read_text())
    assert result["rounds"] == 2 and result["faults"] == 20 and result["wrong_bytes"] == 0
    assert result["pages_written"] == 64 and result["bit_flip"] + result["zeroed_4k"] + result["truncated"] <= 20
