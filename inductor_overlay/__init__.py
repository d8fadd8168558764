"""Flashlight's extensions to TorchInductor, laid out like ``torch/_inductor``.

Nothing here runs until :mod:`torch_patches` installs it; every entry point checks
:func:`inductor_overlay.state.overlay_active` so a suspended overlay is upstream Inductor.
"""

__version__ = "0.1.0"
