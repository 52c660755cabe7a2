#!/usr/bin/env bash
# Installs Debian's headless-capable Chromium and its driver for tests/test_playground.py, if missing.
# Idempotent; needs root (CI and the dev machines run as root). No browser is downloaded from
# anywhere but the distribution's own packages.
set -euo pipefail

if [ -x /usr/bin/chromium ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "[install-chromium] /usr/bin/chromium is missing and this is not root: run 'apt-get install chromium chromium-driver' as root" >&2
  exit 1
fi
echo "[install-chromium] installing chromium and chromium-driver with apt-get"
apt-get update -qq
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium chromium-driver fonts-liberation
/usr/bin/chromium --version
