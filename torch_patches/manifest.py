"""Every upstream symbol Flashlight changes, the overlay code that changes it, and why.

Refresh a fingerprint after checking an upstream change: ``python tools/refresh_fingerprints.py``.
"""

from torch_patches.core import Patch


def _wrap_compile_fx(original):
    from inductor_overlay.compile_fx import wrap_compile_fx

    return wrap_compile_fx(original)


def _wrap_sfdp_params_check(original):
    from inductor_overlay.fx_passes.fuse_attention import wrap_sfdp_params_check

    return wrap_sfdp_params_check(original)


def _wrap_should_pad(original):
    from inductor_overlay.fx_passes.pad_mm import wrap_should_pad

    return wrap_should_pad(original)


def _sfdp_check_cells():
    from inductor_overlay.fx_passes.fuse_attention import registered_pattern_check_cells

    return registered_pattern_check_cells()


MANIFEST: tuple[Patch, ...] = (
    Patch(
        module="torch._inductor.compile_fx",
        qualname="compile_fx",
        make_replacement=_wrap_compile_fx,
        fingerprint="c85e422d8baa3e33766cbbe2edba50fb9b72225827eb5d281a7dff02ecb4f4d9",
        why="entry point: installs the overlay's post-grad pass and falls back to upstream on any overlay fault",
    ),
    Patch(
        module="torch._inductor.fx_passes.fuse_attention",
        qualname="_sfdp_params_check",
        make_replacement=_wrap_sfdp_params_check,
        fingerprint="b69be414a84b5e655bb23c38ef3dadb0890b53fcadabfc6787bbd9902e357f2a",
        why="SDPA pattern policy: lets config.sdpa_pattern_policy='flashlight' decline upstream's rewrite to SDPA",
        captured_by=_sfdp_check_cells,
    ),
    Patch(
        module="torch._inductor.fx_passes.pad_mm",
        qualname="should_pad",
        make_replacement=_wrap_should_pad,
        fingerprint="3d09710f97f93f46a97bd146eb394aec27c0fb2dbf0a0e873b4547770155fe1b",
        why="matmul padding: declined for attention's matmuls, which a padded form would keep from fusing",
    ),
)
