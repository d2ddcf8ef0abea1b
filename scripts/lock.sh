#!/usr/bin/env bash
# Refresh scripts/constraints.txt: resolve the whole set-up afresh, unpinned, in a throw-away venv, and write
# the exact version of every package it installed. Review the diff (a new major version, a native wheel that
# changed build) and run the tests before committing it.
#   bash scripts/lock.sh
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
KVTIER_VENV="$tmp/venv" KVTIER_UNLOCKED=1 bash "$here/scripts/setup.sh"
{
  echo "# Known-good versions of every package scripts/setup.sh installs (CPU set-up, Python $("$tmp/venv/bin/python" -c 'import sys; print("%d.%d" % sys.version_info[:2])'), x86-64 Linux)."
  echo "# Made by 'bash scripts/lock.sh' on $(date -u +%Y-%m-%d); setup.sh installs with '-c' this file."
  "$tmp/venv/bin/python" -m pip freeze --all --exclude-editable | LC_ALL=C sort -f
} >"$here/scripts/constraints.txt"
echo "[lock] wrote scripts/constraints.txt ($(grep -vc '^#' "$here/scripts/constraints.txt") packages)"
