"""Every upstream symbol Flashlight changes, the overlay code that changes it, and why.

Refresh a fingerprint after checking an upstream change: ``python tools/refresh_fingerprints.py``.
"""

from torch_patches.core import Patch


def _wrap_compile_fx(original):
    from inductor_overlay.compile_fx import wrap_compile_fx

    return wrap_compile_fx(original)


MANIFEST: tuple[Patch, ...] = (
    Patch(
        module="torch._inductor.compile_fx",
        qualname="compile_fx",
        make_replacement=_wrap_compile_fx,
        fingerprint="c85e422d8baa3e33766cbbe2edba50fb9b72225827eb5d281a7dff02ecb4f4d9",
        why="entry point: installs the overlay's post-grad pass and falls back to upstream on any overlay fault",
    ),
)
