#!/usr/bin/env bash
# The project's one test command (README and .ci/run both call it): installs what the tests need, then runs them.
#
#   bash tools/test.sh                          the CI tier (what .ci/run runs)
#   bash tools/test.sh --full                   the full tier: the CI tier and the long sweeps (@pytest.mark.full)
#   bash tools/test.sh test/test_demo.py -x     pytest arguments pass through (one file, -k, -x, ...)
#
# Tests run on every core, up to 4 (pytest-xdist; FLASHLIGHT_TEST_WORKERS overrides the count, 0 runs them in one
# process, as --pdb needs), and the slowest are listed at the end of every run, so that growth is visible.
set -euo pipefail
cd "$(dirname "$0")/.."

installed() {
  # -P: the installed package, not the checkout the current directory would put first on sys.path
  python3 -P - <<'PY' 2>/dev/null
import importlib.metadata as metadata, pathlib, sys
import flashlight
pins = {"torch": "2.11.0", "transformers": "5.24.0"}
if any(not metadata.version(name).startswith(version) for name, version in pins.items()):
    sys.exit(1)
if int(metadata.version("numpy").split(".")[0]) >= 2:  # Triton's interpreter needs NumPy 1.x
    sys.exit(1)
if tuple(int(part) for part in metadata.version("pytest-xdist").split(".")[:2]) < (3, 2):  # --dist worksteal
    sys.exit(1)
for name in ("flashlight-inductor", "pytest", "expecttest", "filelock", "matplotlib"):
    metadata.version(name)
# an editable install of this checkout, not of another clone
sys.exit(pathlib.Path(flashlight.__file__).resolve().parents[1] != pathlib.Path.cwd().resolve())
PY
}
if ! installed; then
  python3 -m pip install --quiet --disable-pip-version-check -e ".[test]"
fi

workers="${FLASHLIGHT_TEST_WORKERS:-$(python3 -c 'import os; print(min(len(os.sched_getaffinity(0)), 4))')}"
parallel=()
if [ "$workers" -gt 0 ]; then
  parallel=(-n "$workers" --dist worksteal)
fi
# The whole suite unless a test file or folder is named (bash tools/test.sh test/test_demo.py).
targets=(test)
for argument in "$@"; do
  case "$argument" in
    test/*|./test/*) targets=() ;;
  esac
done
set +e
python3 -m pytest "${targets[@]}" -q -p no:cacheprovider -p no:benchmark --durations=15 "${parallel[@]}" "$@"
status=$?
set -e
if [ "$status" -eq 5 ]; then
  echo "pytest collected no tests: the suite is missing, or the selection matched nothing" >&2
  exit 1
fi
exit "$status"
