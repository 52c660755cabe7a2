#!/usr/bin/env bash
# Re-pins requirements/lock.txt (with hashes) from pyproject.toml; run after changing dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
tools=$(mktemp -d)
trap 'rm -rf "$tools"' EXIT
python3 -m venv "$tools" && "$tools/bin/pip" install --quiet uv==0.13.8
"$tools/bin/uv" pip compile pyproject.toml --extra test --extra eval --generate-hashes --python-version 3.11 \
  --custom-compile-command "scripts/lock.sh" -o requirements/lock.txt
