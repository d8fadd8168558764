"""Flashlight: fused attention kernels from plain PyTorch, as an overlay on TorchInductor."""

from setuptools import find_packages, setup

setup(
    name="flashlight-inductor",
    version="0.1.0",
    description="Fuses attention written in plain PyTorch into one online-softmax Triton kernel under torch.compile",
    python_requires=">=3.10",
    packages=find_packages(include=["flashlight*", "inductor_overlay*", "torch_patches*"]),
    # Kernel templates (rendered by inductor_overlay/kernel/*.py).
    package_data={"inductor_overlay.kernel": ["templates/*.jinja"]},
    install_requires=[
        "torch==2.11.0",
        # Triton 3.6's interpreter (the CPU test path) needs NumPy 1.x for looped reductions.
        "numpy<2",
    ],
    # transformers: test/test_hf_models.py compiles Hugging Face's own attention code (pinned: its idioms change).
    extras_require={"test": ["pytest>=7", "pytest-xdist>=3.2", "expecttest", "filelock", "matplotlib", "transformers==5.24.0"]},
    entry_points={
        # torch loads this group at the end of `import torch`; the hook only arms a lazy import hook.
        "torch.backends": ["flashlight = flashlight._autoload:autoload"],
    },
)
