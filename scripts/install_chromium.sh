#!/usr/bin/env bash
# Headless Chromium for the UI test (tests/test_long_runs_deployment.py drives it over the DevTools protocol):
# Debian's `chromium` package. Installed once, as root; elsewhere, says how (the UI test is then skipped).
set -u
command -v chromium >/dev/null && exit 0
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null && exit 0
  echo "install_chromium: apt-get install chromium failed" >&2
  exit 1
fi
echo "install_chromium: no chromium on PATH; install it (Debian: sudo apt-get install chromium) for the UI test," \
  "which is skipped without it" >&2
