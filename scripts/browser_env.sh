#!/bin/sh
# Install Debian's chromium and chromium-driver, which the dashboard's browser tests drive
# (tests/test_dashboard_browser.py, through Selenium; nothing is downloaded when they run).
#
#   sh scripts/browser_env.sh        # what `make browser-env` (and so `make test`) runs
#
# Nothing to do when both are on PATH. Otherwise apt-get installs them: as root, or through sudo.
# A lock file makes two concurrent runs on one machine wait for each other.
set -eu
if command -v chromium >/dev/null 2>&1 && command -v chromedriver >/dev/null 2>&1; then
  echo "chromium and chromedriver present: $(command -v chromium), $(command -v chromedriver)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium or chromedriver missing and no apt-get here: install Chromium and its" \
    "chromedriver (same version) so that both are on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
LOCK="${TMPDIR:-/tmp}/tokenmill-browser-env.lock"
(
  flock 9
  if ! command -v chromium >/dev/null 2>&1 || ! command -v chromedriver >/dev/null 2>&1; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver
  fi
) 9>"$LOCK"
chromium --version
