#!/usr/bin/env bash
# Sets up (idempotent), then runs the whole test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# The playground's browser test drives Debian's Chromium (installed with apt-get if missing).
bash scripts/install-chromium.sh || echo "[test] no Chromium: the playground browser test will be skipped" >&2
# The layers (pyproject.toml, [tool.importlinter]): an import across them fails the tests.
.venv/bin/lint-imports --no-cache
exec .venv/bin/python -m pytest "$@"
