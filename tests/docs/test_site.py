"""The documentation site builds with ``mkdocs build --strict`` (every nav page present, every link and anchor
resolved, no warning), and its generated reference pages carry what the package defines."""

from __future__ import annotations

import os
import subprocess
import sys

from docs_support import ROOT, kvtier_series


def test_the_site_builds_strictly(tmp_path):
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                          str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"mkdocs build --strict failed:\n{run.stdout}\n{run.stderr}"
    assert "WARNING" not in run.stderr, run.stderr

    pages = {path: path.read_text() for path in site.rglob("*.html")}
    assert not [p for p, html in pages.items() if "<!-- kvtier:" in html], "a marker was left unexpanded"
    assert not list(site.rglob("*.py")) and not list(site.rglob("*.pyc")), "the hooks' files were published"

    configuration = (site / "reference" / "configuration" / "index.html").read_text()
    for key in ("devices", "capacity_bytes", "durability", "throttle", "fault_injection"):
        assert f'id="{key}"' in configuration, key
    assert 'id="fault_injectiondown"' in configuration and 'id="throttle-keys"' in configuration

    metrics = (site / "reference" / "metrics" / "index.html").read_text()
    missing = [name for name in kvtier_series() if f"<code>{name}</code>" not in metrics]
    assert not missing, f"series missing from the built metrics page: {missing}"

    commands = (site / "reference" / "cli" / "index.html").read_text()
    for name in ("inspect", "fsck", "check-shared", "pool-format", "demo", "launch"):
        assert f"usage: sgl-kvtier {name}" in commands, name
