#!/usr/bin/env bash
# The project's test command (README, .ci/run): installs what the tests need, then runs them.
# With CI=true the slow suite (20-trial crash runs and other long tests) runs too.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v chromium >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  # headless Chromium renders the server's status page in one test
  { apt-get update -qq && apt-get install -y -qq chromium >/dev/null; } \
    || echo "run_tests: chromium could not be installed; the status-page browser test will skip"
fi
pip install -q -e '.[test]'
python -m pytest -q "$@"
if [ "${CI:-}" = "true" ]; then
  python -m pytest -q -m slow "$@"
fi
