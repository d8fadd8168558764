"""Run Triton's front end for an NVIDIA GPU on kernels Inductor generated on the CPU harness.

    python -m flashlight.triton_front_end KERNEL_MODULE.py [...]
    python -m flashlight.triton_front_end --ptxas NAME=VALUE,... --warps W --stages S KERNEL_MODULE.py [...]

Triton's interpreter, which runs the CPU tests, executes a kernel as Python and never type-checks it: a kernel the
GPU compiler rejects (a loop-carried variable that changes type, say) passes there, and on the GPU the overlay then
falls back to upstream Inductor, correct but slow. This lowers each kernel's AST to Triton IR for sm90, the step
that raises those errors, without a GPU. It runs in a process of its own: once the interpreter has run kernels in
a process, Triton's language module there no longer lowers to IR. ``flashlight.testing.check_gpu_front_end`` calls it.

With ``--ptxas`` each kernel is compiled on to sm90's machine code instead, its constants first set as the GPU's
configs set them (``NAME=VALUE``: the tiles, ``UPCAST_DOT_OPERANDS=False``), and what ptxas reports of it is printed:
registers, spills, and the loss it names when it serializes the kernel's wgmma (C7515), which the interpreter
cannot show. ``flashlight.testing.hopper_ptxas_reports`` calls it.
"""

import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile


def _kernel_of(path: pathlib.Path, name: str):
    """The kernel ``name`` that the Inductor kernel module at ``path`` defines (its caching autotuner)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def lower_to_ir(path: pathlib.Path, capability: int = 90) -> None:
    """Lower the kernel defined in ``path`` (an Inductor kernel module named after its kernel) to Triton IR."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel = _kernel_of(path, path.stem)
    meta, config = kernel.triton_meta, kernel.configs[0]
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    options = backend.parse_options({"num_warps": config.num_warps, "num_stages": config.num_stages})
    source = ASTSource(fn=kernel.fn, signature=meta["signature"], constexprs={**meta.get("constants", {}), **config.kwargs})
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    source.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), context)


def _with_constants(source: str, constants: dict[str, str]) -> str:
    """``source`` with each ``NAME : tl.constexpr = VALUE`` the template rendered set to ``constants[NAME]``."""
    for name, value in constants.items():
        line = re.compile(rf"^( *){name} : tl\.constexpr = .*$", re.M)
        source, count = line.subn(rf"\g<1>{name} : tl.constexpr = {value}", source)
        assert count == 1, f"{name} is not a constant of the kernel"
    return source


def ptxas_report(
    path: pathlib.Path, constants: dict[str, str], num_warps: int, num_stages: int, capability: int = 90
) -> str:
    """What ptxas reports (``-v``) of the kernel in ``path`` compiled for ``capability`` with ``constants`` set."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    from triton.compiler import ASTSource

    with tempfile.TemporaryDirectory() as directory:
        module_path = pathlib.Path(directory) / path.name
        module_path.write_text(_with_constants(path.read_text(), constants))
        kernel = _kernel_of(module_path, path.stem)
        signature = kernel.triton_meta["signature"]
        # Every pointer 16-byte aligned, as CUDA's allocations are (the CPU harness's arrays need not be).
        aligned = {(i,): [["tt.divisibility", 16]] for i, kind in enumerate(signature.values()) if kind[0] == "*"}
        arguments = kernel.triton_meta.get("constants", {})  # arguments Inductor passes as constants
        source = ASTSource(fn=kernel.fn, signature=signature, constexprs=arguments, attrs=aligned)
        compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": num_warps, "num_stages": num_stages})
        ptx = pathlib.Path(directory) / "kernel.ptx"
        ptx.write_text(compiled.asm["ptx"])
        arch = sm_arch_from_capability(capability)
        command = [get_ptxas(capability).path, "-v", f"--gpu-name={arch}", str(ptx), "-o", f"{ptx}.o"]
        done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return done.stdout + done.stderr


def _option(name: str, default: str | None) -> str | None:
    return sys.argv[sys.argv.index(name) + 1] if name in sys.argv else default


def main() -> int:
    failed = 0
    ptxas = _option("--ptxas", None)
    options = {"--ptxas", "--warps", "--stages"}
    paths = [a for i, a in enumerate(sys.argv[1:], 1) if a not in options and sys.argv[i - 1] not in options]
    for name in paths:
        path = pathlib.Path(name)
        try:
            if ptxas is None:
                lower_to_ir(path)
            else:
                constants = dict(pair.split("=", 1) for pair in ptxas.split(","))
                report = ptxas_report(path, constants, int(_option("--warps", "4")), int(_option("--stages", "3")))
                print(f"== {path.stem}\n{report}", flush=True)
        except Exception as error:  # report every kernel, then fail
            failed += 1
            print(f"{path.stem}: {type(error).__name__}: {error}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
