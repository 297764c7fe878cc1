#!/usr/bin/env bash
# The system packages some tests need, installed where this user can: bubblewrap (tests/test_agent_*.py and the
# agentic post-training tests run commands in bwrap sandboxes) and Chromium with its driver (tests/test_web.py
# drives the chat page). Uses apt-get as root, or through `sudo -n` (no password prompt). Idempotent.
#   --require   fail (exit 1) if a package is missing and cannot be installed (.ci/run); without it, say what is
#               missing and go on (scripts/test.sh: those tests then skip, and pytest's last line counts them)
set -uo pipefail
require=0
[ "${1:-}" = "--require" ] && require=1
missing=()
command -v bwrap >/dev/null || missing+=(bubblewrap)
{ [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; } || missing+=(chromium chromium-driver)
[ ${#missing[@]} -eq 0 ] && exit 0
sudo=()
if [ "$(id -u)" -ne 0 ]; then
  if command -v sudo >/dev/null && sudo -n true 2>/dev/null; then sudo=(sudo -n); else sudo=(none); fi
fi
if [ "${sudo[0]:-}" != none ] && command -v apt-get >/dev/null; then
  echo "setup: installing ${missing[*]} (apt-get) for the sandbox and browser tests"
  if { "${sudo[@]}" apt-get update -qq && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -qq \
      "${missing[@]}" >/dev/null; }; then
    exit 0
  fi
  echo "setup: apt-get could not install ${missing[*]}" >&2
else
  echo "setup: ${missing[*]} missing and not installable here (needs root or passwordless sudo, and apt-get)" >&2
fi
if [ "$require" -eq 1 ]; then exit 1; fi
echo "setup: the tests that need them will skip; to run them: sudo apt-get install ${missing[*]}" >&2
exit 0
