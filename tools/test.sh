#!/usr/bin/env bash
# The project's one test command (README and .ci/run both call it): installs what the tests need, then runs them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
set +e
python3 -m pytest test -q -p no:cacheprovider "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: the suite is missing" >&2
  exit 1
fi
exit "$status"
