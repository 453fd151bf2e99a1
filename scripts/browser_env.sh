#!/bin/sh
# Install Debian's chromium and chromium-driver, which the dashboard's browser tests drive
# (tests/test_dashboard_browser.py, through Selenium; nothing is downloaded when they run), and
# Debian's prometheus for its promtool, which evaluates the shipped alert rules
# (tests/test_grafana.py).
#
#   sh scripts/browser_env.sh        # what `make browser-env` (and so `make test`) runs
#
# Nothing to do when both are on PATH. Otherwise apt-get installs them: as root, or through sudo.
# A lock file makes two concurrent runs on one machine wait for each other.
set -eu
present() { command -v chromium && command -v chromedriver && command -v promtool; } >/dev/null 2>&1
if present; then
  echo "chromium, chromedriver and promtool present: $(command -v chromium), $(command -v promtool)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "chromium, chromedriver or promtool missing and no apt-get here: install Chromium and its" \
    "chromedriver (same version) and Prometheus's promtool so that all three are on PATH" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
LOCK="${TMPDIR:-/tmp}/tokenmill-browser-env.lock"
(
  flock 9
  if ! present; then
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get update -q
    $SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
      chromium chromium-driver prometheus
  fi
) 9>"$LOCK"
chromium --version
