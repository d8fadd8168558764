"""How much the installed autoload hook adds to `import torch`: median of fresh interpreters, hook on vs off."""

import os
import statistics
import subprocess
import sys

RUNS = int(os.environ.get("RUNS", "15"))
PROBE = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
# The hook's own cost, timed in-process: importing the entry-point module and arming the import hook.
DIRECT = (
    "import time; t = time.perf_counter(); import flashlight._autoload as hook; hook.autoload(); "
    "print(time.perf_counter() - t)"
)


def median_seconds(probe: str, disable: bool) -> float:
    env = dict(os.environ, FLASHLIGHT_DISABLE="1" if disable else "0")
    samples = []
    for _ in range(RUNS):
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
        samples.append(float(out.stdout.strip().splitlines()[-1]))
    return statistics.median(samples)


if __name__ == "__main__":
    median_seconds(PROBE, disable=False)  # warm the file cache
    off = median_seconds(PROBE, disable=True)
    on = median_seconds(PROBE, disable=False)
    direct = median_seconds(DIRECT, disable=False)
    print(f"import torch: {off * 1e3:.0f} ms with FLASHLIGHT_DISABLE=1, {on * 1e3:.0f} ms with the hook armed "
          f"(difference {(on - off) * 1e3:+.1f} ms, median of {RUNS}); the hook itself: {direct * 1e3:.2f} ms")
