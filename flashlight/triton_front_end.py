"""Run Triton's front end for an NVIDIA GPU on kernels Inductor generated on the CPU harness.

    python -m flashlight.triton_front_end KERNEL_MODULE.py [...]

Triton's interpreter, which runs the CPU tests, executes a kernel as Python and never type-checks it: a kernel the
GPU compiler rejects (a loop-carried variable that changes type, say) passes there, and on the GPU the overlay then
falls back to upstream Inductor, correct but slow. This lowers each kernel's AST to Triton IR for sm90, the step
that raises those errors, without a GPU. It runs in a process of its own: once the interpreter has run kernels in
a process, Triton's language module there no longer lowers to IR. ``flashlight.testing.check_gpu_front_end`` calls it.
"""

import importlib.util
import pathlib
import sys


def lower_to_ir(path: pathlib.Path, capability: int = 90) -> None:
    """Lower the kernel defined in ``path`` (an Inductor kernel module named after its kernel) to Triton IR."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    kernel = getattr(module, path.stem)
    meta, config = kernel.triton_meta, kernel.configs[0]
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages})
    source = ASTSource(fn=kernel.fn, signature=meta["signature"], constexprs={**meta.get("constants", {}), **config.kwargs})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


def main() -> int:
    failed = 0
    for name in sys.argv[1:]:
        path = pathlib.Path(name)
        try:
            lower_to_ir(path)
        except Exception as error:  # report every kernel, then fail
            failed += 1
            print(f"{path.stem}: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
