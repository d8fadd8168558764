"""Compile and run Inductor's Triton kernels on the CPU, for tests and for users without a GPU.

Inductor generates Triton code for CPU tensors when ``cpu_backend == "triton"``, and Triton's interpreter
(``TRITON_INTERPRET=1``) runs it with NumPy. Two gaps remain on a machine with no GPU, bridged here inside
:func:`cpu_triton` and undone when it exits:

* Triton finds no active driver, but Inductor's codegen asks it for a target: a stub driver answers.
* ``triton.language.extra.libdevice`` functions are empty stubs under the interpreter (they return None):
  NumPy implementations stand in for the ones Inductor emits.
* The interpreter reduces with a Python call per element unless it knows the combine function: Inductor's own
  (``triton_helpers.maximum``, ``minimum``, ``_any_combine``: the NaN-propagating max and min and ``any``) run as
  NumPy reductions with the same meaning, so the mask tables' reductions take milliseconds, not minutes.
* The interpreter runs no inline assembly: the overlay's one instruction (``tanh.approx.f32``, which the GPU
  path emits) runs as NumPy's exact tanh, so a test can force that path and check its wiring.

Inside the block, buffers the compiled code allocates are poisoned (NaN), so unwritten output elements show.

Usage::

    with flashlight.testing.cpu_triton():
        out, code = flashlight.testing.compile_and_get_code(fn, q, k, v)
    flashlight.testing.check_kernels(code, kernels=1)
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import warnings
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

_INTERPRET = "TRITON_INTERPRET"


def _stub_driver() -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        """Answers codegen's questions (target, device) on a machine with no GPU driver."""

        @classmethod
        def is_active(cls) -> bool:
            return False

        def map_python_to_cpp_type(self, ty: str) -> str:
            return ty

        def get_current_target(self) -> Any:
            return GPUTarget("cuda", 80, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_benchmarker(self) -> Any:
            from triton.testing import do_bench

            return do_bench

    return InterpreterDriver()


def _np_unary(fn: Callable[..., np.ndarray]) -> Callable[..., Any]:
    def call(*args: Any, **_: Any) -> Any:
        import triton.language as tl
        from triton.runtime.interpreter import TensorHandle

        tensors = [a for a in args if isinstance(a, tl.core.tensor)]
        like = tensors[0]
        data = [a.handle.data if isinstance(a, tl.core.tensor) else a for a in args]
        with np.errstate(all="ignore"):
            result = np.asarray(fn(*data))
        if result.dtype == np.bool_:
            return tl.core.tensor(TensorHandle(result, tl.int1), like.type.with_element_ty(tl.int1))
        result = result.astype(like.handle.data.dtype, copy=False)
        return tl.core.tensor(TensorHandle(result, like.handle.dtype.scalar), like.type)

    return call


def _erf(x: np.ndarray) -> np.ndarray:
    import math

    return np.vectorize(math.erf, otypes=[x.dtype])(x)


_LIBDEVICE_NUMPY: dict[str, Callable[..., np.ndarray]] = {
    "exp": np.exp,
    "exp2": np.exp2,
    "expm1": np.expm1,
    "log": np.log,
    "log2": np.log2,
    "log10": np.log10,
    "log1p": np.log1p,
    "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x),
    "tanh": np.tanh,
    "sin": np.sin,
    "cos": np.cos,
    "tan": np.tan,
    "asin": np.arcsin,
    "acos": np.arccos,
    "atan": np.arctan,
    "atan2": np.arctan2,
    "sinh": np.sinh,
    "cosh": np.cosh,
    "asinh": np.arcsinh,
    "acosh": np.arccosh,
    "atanh": np.arctanh,
    "erf": _erf,
    "abs": np.abs,
    "fabs": np.abs,
    "floor": np.floor,
    "ceil": np.ceil,
    "trunc": np.trunc,
    "round": np.round,
    "nearbyint": np.rint,
    "rint": np.rint,
    "pow": np.power,
    "fmod": np.fmod,
    "fmax": np.fmax,
    "fmin": np.fmin,
    "copysign": np.copysign,
    "hypot": np.hypot,
    "isinf": np.isinf,
    "isnan": np.isnan,
    "isfinited": np.isfinite,
    "finitef": np.isfinite,
    "signbit": np.signbit,
    "sigmoid": lambda x: 1.0 / (1.0 + np.exp(-x)),
}


def _numpy_inline_asm(asm: str, constraints: str, args: Sequence[Any], dtype: Any, is_pure: bool, pack: int) -> Any:
    from inductor_overlay.kernel.online_softmax_attention import APPROXIMATE_TANH_ASM

    if asm != APPROXIMATE_TANH_ASM or pack != 1:
        raise NotImplementedError(f"inline assembly {asm!r} under the interpreter")
    return _np_unary(np.tanh)(*args)


def _interpreted_device_function_call() -> Callable[..., Any]:
    """A ``JITFunction.__call__`` that runs ``@triton.jit`` helpers (``tl.sum``, Inductor's ``triton_helpers``)
    through the interpreter: helpers decorated before ``TRITON_INTERPRET`` was set are compiled-mode
    ``JITFunction``s, which refuse to be called from Python."""
    from triton.runtime.interpreter import InterpretedFunction

    interpreted: dict[int, InterpretedFunction] = {}

    def call_interpreted(self: Any, *args: Any, **kwargs: Any) -> Any:
        helper = interpreted.setdefault(id(self), InterpretedFunction(self.fn))
        return helper(*args, **kwargs)

    return call_interpreted


def _numpy_reductions(reduce_elementwise: Callable[..., Any]) -> Callable[..., Any]:
    """A ``ReduceOps.apply_impl`` that runs Inductor's combine functions as NumPy ufunc reductions: ``maximum`` and
    ``minimum`` propagate NaN as ``np.maximum``/``np.minimum`` do, ``_any_combine`` is ``a | b``. Any other combine
    function keeps the interpreter's element-by-element reduction."""
    from torch._inductor.runtime import triton_helpers

    # Keyed by identity: hashing a JITFunction computes its cache key, which the interpreter's patches break.
    ufuncs = {
        id(triton_helpers.maximum): np.maximum,
        id(triton_helpers.minimum): np.minimum,
        id(triton_helpers._any_combine): np.bitwise_or,
    }

    def apply_impl(self: Any, input: Any) -> Any:
        ufunc = ufuncs.get(id(self.combine_fn))
        if ufunc is None or len(input) != 1:
            return reduce_elementwise(self, input)
        data = input[0].handle.data
        return self.to_tensor(ufunc.reduce(data, axis=self.axis, keepdims=self.keep_dims), input[0].dtype)

    return apply_impl


def _boolean_comparisons() -> dict[str, Callable[..., Any]]:
    """The interpreter's comparisons with the type Triton gives them, int1. Its own record the left operand's type, so
    a comparison of a scalar (a per-head value loaded once per program), once broadcast against a tile, becomes a
    tensor of 0.0 and 1.0 in that type, and ``|`` with a boolean tile fails in NumPy; the GPU compiler types it int1."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpreterBuilder, TensorHandle

    def boolean(compare: Callable[..., Any]) -> Callable[..., Any]:
        def compare_as_int1(self: Any, lhs: Any, rhs: Any) -> Any:
            return TensorHandle(np.asarray(compare(self, lhs, rhs).data, dtype=np.bool_), tl.int1)

        return compare_as_int1

    names = [name for name in vars(InterpreterBuilder) if name.startswith(("create_fcmp", "create_icmp"))]
    return {name: boolean(getattr(InterpreterBuilder, name)) for name in names}


def _poisoned_allocator(allocate: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """Buffers that compiled code allocates on the CPU start as NaN (or an extreme integer), so an element a kernel
    forgets to write shows up in the comparison with eager instead of passing on leftover memory."""

    def empty_strided_poisoned(size: Any, stride: Any, dtype: torch.dtype) -> torch.Tensor:
        return poisoned_like(allocate(size, stride, dtype))

    return empty_strided_poisoned


# Warnings of the CPU harness that say nothing about the program: NumPy's RuntimeWarnings inside Triton's
# interpreter on values a kernel computes and then masks or discards (exp2 and log of a fully masked row's -inf, casts
# of a ragged tile's padding; the results themselves are checked), the interpreter's own NumPy deprecation, and
# Inductor's note that the CPU has no Triton backend (the interpreter is the backend). Filters in pytest's syntax.
INTERPRETER_WARNINGS = (
    r"ignore::RuntimeWarning:triton\.runtime\.interpreter",
    r"ignore::DeprecationWarning:triton\.runtime\.interpreter",
    "ignore:Could not find an active CPU backend:UserWarning",
)


def quiet_interpreter_warnings() -> None:
    """``INTERPRETER_WARNINGS`` filtered for the rest of the process (the demo on a CPU machine)."""
    for category in (RuntimeWarning, DeprecationWarning):
        warnings.filterwarnings("ignore", category=category, module=r"triton\.runtime\.interpreter")
    warnings.filterwarnings("ignore", message="Could not find an active CPU backend", category=UserWarning)


@contextlib.contextmanager
def cpu_triton() -> Iterator[None]:
    """Inside the block, Inductor compiles CPU tensors to Triton and runs the kernels in the interpreter."""
    from unittest import mock

    from torch._inductor import config as inductor_config
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime.driver import driver
    from triton.runtime.interpreter import InterpreterBuilder, ReduceOps
    from triton.runtime.jit import JITFunction

    guards = torch._C._dynamo.guards
    numpy_libdevice = {name: _np_unary(fn) for name, fn in _LIBDEVICE_NUMPY.items() if hasattr(libdevice, name)}
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(os.environ, {_INTERPRET: "1"}))
        if not torch.cuda.is_available():
            stack.enter_context(mock.patch.object(driver, "_active", _stub_driver()))
        stack.enter_context(mock.patch.multiple(libdevice, **numpy_libdevice))
        stack.enter_context(mock.patch.object(tl, "inline_asm_elementwise", _numpy_inline_asm))
        stack.enter_context(mock.patch.object(JITFunction, "__call__", _interpreted_device_function_call()))
        stack.enter_context(mock.patch.object(ReduceOps, "apply_impl", _numpy_reductions(ReduceOps.apply_impl)))
        stack.enter_context(mock.patch.multiple(InterpreterBuilder, **_boolean_comparisons()))
        stack.enter_context(
            mock.patch.object(guards, "_empty_strided_cpu", _poisoned_allocator(guards._empty_strided_cpu))
        )
        stack.enter_context(inductor_config.patch(cpu_backend="triton", compile_threads=1))
        stack.enter_context(_gpu_dependency_matching())
        yield


def _gpu_dependency_matching() -> contextlib.AbstractContextManager:
    """CPU scheduler nodes keep their loops unmerged, as GPU nodes do under Inductor's loop ordering after fusion
    (``SchedulerNode._compute_attrs`` normalises dependencies only off the GPU). Fusion then matches an epilogue's
    reads to its producer's writes as it does on the GPU: a kernel that fuses here fuses there."""
    from unittest import mock

    from torch._inductor import scheduler

    real_is_gpu = scheduler.is_gpu

    def is_gpu(device_type: str) -> bool:
        computing_dependencies = sys._getframe(1).f_code.co_name == "_compute_attrs"
        return real_is_gpu(device_type) or (device_type == "cpu" and computing_dependencies)

    return mock.patch.object(scheduler, "is_gpu", is_gpu)


def compile_and_get_code(
    fn: Callable[..., Any],
    *args: Any,
    compile_options: dict[str, Any] | None = None,
    fresh_cache: bool = True,
    **kwargs: Any,
) -> tuple[Any, list[str]]:
    """``torch.compile(fn, **compile_options)(*args, **kwargs)``, compiled afresh; returns (output, sources)."""
    from torch._inductor.utils import fresh_cache as fresh_inductor_cache, run_and_get_code

    torch._dynamo.reset()
    cache = fresh_inductor_cache() if fresh_cache else contextlib.nullcontext()
    with cache:
        return run_and_get_code(torch.compile(fn, **(compile_options or {})), *args, **kwargs)


def run_keeping_graphs_and_get_code(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Any, list[str]]:
    """``fn(*args, **kwargs)`` and the sources of the graphs compiled during the call. Unlike Inductor's
    ``run_and_get_code`` it does not reset Dynamo first, so a call reuses (or recompiles, as dynamic) the graphs
    earlier calls compiled."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    sources: list[str] = []
    with mock.patch.object(GraphLowering, "save_output_code", sources.append):
        return fn(*args, **kwargs), sources


_KERNEL_DEF = re.compile(r"@triton\.jit\s*\ndef (\w+)\(")


def triton_kernels(code: str | Sequence[str]) -> dict[str, str]:
    """Name -> source of every Triton kernel defined in the generated module(s)."""
    text = code if isinstance(code, str) else "\n".join(code)
    kernels = {}
    for match in _KERNEL_DEF.finditer(text):
        body_start = match.start()
        end = text.find("''', device_str=", body_start)
        kernels[match.group(1)] = text[body_start : end if end != -1 else len(text)]
    return kernels


def check_gpu_front_end(code: str | Sequence[str]) -> None:
    """Every Triton kernel in the generated module(s) passes Triton's front end for sm90 (``triton_front_end``):
    the interpreter that runs the CPU tests would not reject a kernel the GPU compiler rejects."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        paths = _write_kernel_modules(code, directory)
        assert paths, "no Triton kernel in the generated code"
        command = [sys.executable, "-m", "flashlight.triton_front_end", *paths]
        done = subprocess.run(command, capture_output=True, text=True)
    assert done.returncode == 0, f"Triton's front end rejected a kernel:\n{done.stdout}{done.stderr[-3000:]}"


def hopper_ptxas_reports(
    code: str | Sequence[str], constants: dict[str, Any], num_warps: int, num_stages: int, contains: str
) -> dict[str, str]:
    """Name -> what ptxas reports of each Triton kernel in the generated module(s) whose source has ``contains``,
    compiled for sm90 with ``constants`` set as a GPU config sets them (``flashlight.triton_front_end --ptxas``):
    its registers, its spills, and whether it serializes the kernel's wgmma (C7515), which the CPU harness cannot
    show."""
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        paths = _write_kernel_modules(code, directory, contains)
        assert paths, f"no Triton kernel with {contains!r} in the generated code"
        pairs = ",".join(f"{name}={value}" for name, value in constants.items())
        command = [sys.executable, "-m", "flashlight.triton_front_end", "--ptxas", pairs, "--warps", str(num_warps),
                   "--stages", str(num_stages), *paths]
        environment = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
        done = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=600)
    assert done.returncode == 0, f"compiling for sm90 failed:\n{done.stdout}{done.stderr[-3000:]}"
    reports = re.split(r"^== (\w+)\n", done.stdout, flags=re.M)[1:]
    return dict(zip(reports[::2], reports[1::2]))


_KERNEL_MODULE = re.compile(r"async_compile\.triton\('(\w+)', '''")
_KERNEL_MODULE_END = "''', device_str="


def _write_kernel_modules(code: str | Sequence[str], directory: str, contains: str = "") -> list[str]:
    """The paths of the Triton kernel modules in the generated module(s) whose source has ``contains``, each
    written to ``directory`` under its kernel's name (``flashlight.triton_front_end`` loads them)."""
    text = code if isinstance(code, str) else "\n".join(code)
    paths = []
    for match in _KERNEL_MODULE.finditer(text):
        body = text[match.end() : text.find(_KERNEL_MODULE_END, match.end())]
        if contains in body:
            paths.append(os.path.join(directory, f"{match.group(1)}.py"))
            with open(paths[-1], "w") as handle:
                handle.write(body)
    return paths


_BOUNDED_REMAINDER = re.compile(r"^( *)if not (?:EVEN_N|\(EVEN_M and EVEN_N\)):\n\1    for \w+ in range\(split_")


def without_bounded_remainders(text: str) -> str:
    """``text`` without the second half of each loop split where its tiles leave the bounds (a ragged length): the
    loop over the tiles past ``split_…`` under ``if not EVEN_…:``, which repeats the first half's body with the
    bounds tests. What remains has one copy of each loop, as a kernel whose lengths divide the tiles."""
    lines, kept, skip_deeper_than = text.split("\n"), [], None
    for number, line in enumerate(lines):
        indent = len(line) - len(line.lstrip(" "))
        if skip_deeper_than is not None:
            if not line.strip() or indent > skip_deeper_than:
                continue
            skip_deeper_than = None
        if _BOUNDED_REMAINDER.match("\n".join(lines[number : number + 2])):
            skip_deeper_than = indent
            continue
        kept.append(line)
    return "\n".join(kept)


def check_kernels(
    code: str | Sequence[str],
    kernels: int | None = None,
    dots: int | None = None,
    loops: int | None = None,
    extern_calls: int | None = None,
) -> None:
    """FileCheck the generated code: number of Triton kernels, ``tl.dot`` calls, in-kernel loops, extern calls. A
    loop split where its tiles leave the bounds counts once, with its dots (``without_bounded_remainders``)."""
    from torch.testing import FileCheck

    text = without_bounded_remainders(code if isinstance(code, str) else "\n".join(code))
    if kernels is not None:
        FileCheck().check_count("@triton.jit", kernels, exactly=True).run(text)
    if dots is not None:
        FileCheck().check_count("tl.dot(", dots, exactly=True).run(text)
    if loops is not None:
        FileCheck().check_count("in range(", loops, exactly=True).run("\n".join(triton_kernels(text).values()))
    if extern_calls is not None:
        FileCheck().check_count("extern_kernels.", extern_calls, exactly=True).run(text)


def column_tile_loops(kernel: str) -> int:
    """How many loops over column tiles a fused attention kernel has: 1, or 2 when the tiles a mask leaves entirely
    visible get a loop of their own, followed by one loop over the partial tiles on both sides of them (checked);
    one more when they speculate that the scores are finite: the loop over all visited tiles after a failed check.
    A loop split where its tiles leave the bounds counts once (``without_bounded_remainders``)."""
    from torch.testing import FileCheck

    fast, *exact = without_bounded_remainders(kernel).split("speculation_failed = ")
    loops = fast.count("for start_n in range(") + fast.count("for partial_n in tl.range(")
    assert loops in (1, 2), f"{loops} column-tile loops"
    if loops == 2:
        FileCheck().check_regex(r"for start_n in range\(full_lo, (full_hi|split_n), BLOCK_N\)").check(
            "for partial_n in tl.range(0, partial_before + (end_n - full_hi), BLOCK_N, num_stages=PARTIAL_STAGES)"
        ).run(fast)
    if exact:
        FileCheck().check("if tl.max(speculation_failed").check_count(
            "for start_n in tl.range(first_n, end_n, BLOCK_N, num_stages=1)", 1, exactly=True
        ).check_not("for partial_n").run(exact[0])
    return loops + len(exact)


def split_loop_chains(kernel: str) -> tuple[str, str]:
    """The user's chain (from the score dot to the logits) in the loop over entirely visible tiles and in the loop
    over the partial tiles of a kernel with both."""
    visible = re.split(r"for start_n in range\(full_lo, (?:full_hi|split_n), BLOCK_N\)", kernel)[1].split("for partial_n in tl.range(")[0]
    partial = kernel.split("for partial_n in tl.range(")[1]
    return visible.split("scores = tl.dot")[1].split("logits = tmp")[0], partial.split("scores = tl.dot")[1].split("logits = tmp")[0]


def allocated_buffer_numels(code: str | Sequence[str]) -> list[int]:
    """Element counts of every buffer the generated wrapper allocates (``empty_strided_*``)."""
    text = code if isinstance(code, str) else "\n".join(code)
    numels = []
    for sizes in re.findall(r"empty_strided_\w+\(\(([^)]*)\)", text):
        numel = 1
        for size in filter(None, (s.strip() for s in sizes.split(","))):
            numel *= int(size) if size.isdigit() else 0
        numels.append(numel)
    return numels


def poisoned_like(t: torch.Tensor) -> torch.Tensor:
    """``t`` filled in place with NaN (floating), True (bool) or the largest value (integers)."""
    if t.is_floating_point():
        return t.fill_(float("nan"))
    return t.fill_(True if t.dtype == torch.bool else torch.iinfo(t.dtype).max)


def assert_close_to_reference(
    actual: torch.Tensor, reference: torch.Tensor, *, rtol: float | None = None, atol: float | None = None
) -> None:
    """Compare against a float64 reference, NaN positions included (eager NaN rows must stay NaN)."""
    defaults = {torch.float32: (1e-4, 1e-5), torch.float16: (2e-2, 2e-3), torch.bfloat16: (5e-2, 2e-2)}
    default_rtol, default_atol = defaults.get(actual.dtype, (1e-6, 1e-7))
    torch.testing.assert_close(
        actual.double(),
        reference.double(),
        rtol=default_rtol if rtol is None else rtol,
        atol=default_atol if atol is None else atol,
        equal_nan=True,
    )
