"""Print (or, with --write, rewrite) the fingerprints in torch_patches/manifest.py for the installed torch.

Run it only after reading the upstream change behind a mismatch and checking the overlay code still fits it.
"""

import argparse
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from torch_patches.core import fingerprint  # noqa: E402
from torch_patches.manifest import MANIFEST  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="rewrite manifest.py in place")
    args = parser.parse_args()
    manifest_path = ROOT / "torch_patches" / "manifest.py"
    text = manifest_path.read_text()
    for patch in MANIFEST:
        found = fingerprint(patch.current())
        status = "ok" if found == patch.fingerprint else "CHANGED"
        print(f"{status:8} {patch.target} {found}")
        text = text.replace(f'fingerprint="{patch.fingerprint}"', f'fingerprint="{found}"')
    if args.write:
        manifest_path.write_text(text)


if __name__ == "__main__":
    main()
