"""pypto runtime: one place for every quirk of pypto 0.2.0, and kernel calls from numpy.

Two run modes:

* ``"sim"`` (no CANN, ``ASCEND_HOME_PATH`` unset; every CPU machine): pypto traces and compiles the
  kernel for A2/A3, runs its cost model, and, with its pass verifier switched on, executes the kernel's
  tensor graph on the CPU with its torch "calculator". As shipped, 0.2.0 feeds that interpreter all-zero
  copies of the arguments and copies the result over *every* argument; :func:`_patch_verifier` hands the
  interpreter the real CPU tensors instead, so the outputs hold the kernel's numbers. The patch relies on
  internals of exactly pypto 0.2.0, so any other version is refused.
* ``"npu"`` (CANN installed, ``ASCEND_HOME_PATH`` set): kernels run on the NPU through ``torch_npu``.
  This path exists for machines with CANN and an A2/A3 device; it cannot be exercised without one.

Other quirks handled here: the interpreter library is built once per user and cached under
``~/.cache/dspark/pypto`` (30-50 s with cmake/g++), pypto's per-call output folders go to a private
scratch directory and are deleted after each call, outputs are pre-filled with a sentinel and a call
fails loudly if any output element was not written. pypto leaks about 23 MB per call and some of its
errors end the process, so callers that make many calls should use :func:`dspark_kernels.pypto.isolate.run_isolated`.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import importlib.metadata
import importlib.util
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal

import attrs
import ml_dtypes
import numpy as np

from dspark_kernels.pypto.errors import KernelOutputError, PyptoUnavailableError

#: The only pypto version whose internals the CPU patch is written against.
SUPPORTED_PYPTO = "0.2.0"
INSTALL_HINT = "pip install torch==2.13.0 pypto==0.2.0 sympy  (plus g++, binutils and cmake on PATH)"
CACHE_ROOT = Path(os.environ.get("DSPARK_PYPTO_CACHE", Path.home() / ".cache" / "dspark" / "pypto"))

RunMode = Literal["sim", "npu"]


def cost_model_only() -> bool:
    """``DSPARK_PYPTO_COST_ONLY=1``: sim mode without the interpreter (cycle estimates only, outputs unwritten)."""
    return os.environ.get("DSPARK_PYPTO_COST_ONLY", "") == "1"


def run_mode() -> RunMode:
    """'npu' when CANN is configured (``ASCEND_HOME_PATH`` set), else 'sim' (CPU interpreter + cost model)."""
    return "npu" if os.environ.get("ASCEND_HOME_PATH") else "sim"


def _check_installation() -> None:
    try:
        version = importlib.metadata.version("pypto")
    except importlib.metadata.PackageNotFoundError:
        raise PyptoUnavailableError(
            f"the pypto backend needs pypto {SUPPORTED_PYPTO}; install it with: {INSTALL_HINT}") from None
    if version != SUPPORTED_PYPTO:
        raise PyptoUnavailableError(
            f"pypto {version} is installed but dspark_kernels.pypto supports exactly pypto {SUPPORTED_PYPTO} "
            f"(its CPU execution patch depends on that version's internals); install it with: {INSTALL_HINT}")
    for mod in ("torch", "sympy"):
        try:
            importlib.metadata.version(mod)
        except importlib.metadata.PackageNotFoundError:
            raise PyptoUnavailableError(f"pypto needs {mod} but it is not installed; {INSTALL_HINT}") from None
    if run_mode() == "sim":
        # every SIM call compiles host control code with g++/as/ld; the interpreter build needs cmake
        missing = [tool for tool in ("g++", "as", "ld", "objcopy", "cmake") if shutil.which(tool) is None]
        if missing:
            raise PyptoUnavailableError(
                f"pypto's CPU simulation needs {', '.join(missing)} on PATH (apt-get install g++ binutils cmake); "
                "without g++ pypto ends the process with exit code 1")


def _redirect_scratch() -> Path:
    """Point pypto's output, log and run-data folders at a private directory removed at exit."""
    scratch = Path(tempfile.mkdtemp(prefix="dspark-pypto-"))
    os.environ["TILE_FWK_OUTPUT_DIR"] = str(scratch / "output")
    os.environ["ASCEND_PROCESS_LOG_PATH"] = str(scratch / "log")
    os.environ["PYPTO_HOME"] = str(scratch / "home")
    atexit.register(shutil.rmtree, scratch, ignore_errors=True)
    return scratch


def _skip_swimlane_scripts(scratch: Path) -> None:
    """Put a ``python3`` first on PATH that skips pypto's swim-lane scripts and runs everything else.

    Every SIM call runs ``python3 <pypto>/lib/scripts/{print,draw}_swim_lane.py`` through the shell (trace
    pictures only; the cycle count comes from the simulator's own report). On large kernels they take minutes
    and gigabytes (the FLASH sparse-attention kernel: over 3 minutes and 4.4 GB). ``DSPARK_PYPTO_SWIMLANE=1``
    keeps them.
    """
    if os.environ.get("DSPARK_PYPTO_SWIMLANE", "") == "1":
        return
    real = shutil.which("python3")
    if real is None:
        return
    spec = importlib.util.find_spec("pypto")
    scripts = str(Path(spec.origin).parent / "lib" / "scripts") if spec and spec.origin else "/nonexistent"
    shim_dir = scratch / "bin"
    shim_dir.mkdir(parents=True, exist_ok=True)
    shim = shim_dir / "python3"
    shim.write_text(f'#!/bin/sh\ncase "$1" in "{scripts}"/*) exit 0 ;; esac\nexec "{real}" "$@"\n')
    shim.chmod(0o755)
    os.environ["PATH"] = f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}"


_check_installation()
SCRATCH = _redirect_scratch()
_skip_swimlane_scripts(SCRATCH)

import pypto as pypto  # noqa: E402  (explicit re-export: the kernel modules import pypto from here)
import torch  # noqa: E402  (pypto needs torch imported first)
from pypto import pypto_impl  # noqa: E402
from pypto._utils import BuildOnlineManager  # noqa: E402
from pypto.frontend.parser import entry as _entry  # noqa: E402


def _calculator_dir() -> Path:
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return CACHE_ROOT / f"calculator-pypto{SUPPORTED_PYPTO}-torch{torch.__version__}-abi{abi}"


def load_calculator() -> Path:
    """Build pypto's torch interpreter once per user (cached) and load it into this process."""
    manager = BuildOnlineManager()
    target = _calculator_dir()
    library = target / "lib" / "libtile_fwk_calculator.so"
    if manager.calculator_loaded:
        return library
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / (target.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel test processes build it only once
        if not library.exists():
            _build_calculator(manager, target)
    ctypes.CDLL(str(library), mode=ctypes.RTLD_GLOBAL)
    manager.calculator_loaded = True
    return library


def _build_calculator(manager: Any, target: Path) -> None:
    torch_ctx = manager._TorchContext()
    cmake_ctx = manager._CMakeContext()
    with tempfile.TemporaryDirectory(prefix="dspark-pypto-calc-") as tmp:
        ctx = manager._CMakeContext.CompileContext(src_dir=Path(manager.pkg_lib_dir, "calculator"), tmp_dir=Path(tmp))
        ctx.cfg_cmd_ext = (f"-DPY3_MOD_TORCH_VERSION={torch_ctx.torch_version} "
                           f"-DPY3_MOD_TORCH_ROOT_PATH={torch_ctx.torch_root_dir} "
                           f"-DPY3_MOD_TORCH_C_GLIBCXX_USE_CXX11_ABI={torch_ctx.torch_c_use_cxx11_abi}")
        ctx.build_job_num = 2
        installed = cmake_ctx.compile(ctx)
        staging = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
        shutil.copytree(installed, staging, dirs_exist_ok=True)
        staging.rename(target)  # atomic: a half-built cache is never visible


def _patch_verifier() -> None:
    """Give pypto's tensor-graph interpreter the real CPU tensors (pypto 0.2.0 gives it zeroed copies)."""

    def _setup_verify_data(pto_tensors: list[Any]) -> None:
        if not pypto.get_verify_options().get("enable_pass_verify"):
            return
        load_calculator()
        pypto_impl.SetVerifyData(_entry._pto_to_tensor_data(pto_tensors), [], _entry._pto_verify_datas.get_data())

    _entry.JitCallableWrapper._setup_verify_data = staticmethod(_setup_verify_data)


if run_mode() == "sim":
    _patch_verifier()


def jit_options() -> dict[str, Any]:
    """Options for ``pypto.frontend.jit`` in the current run mode.

    sim: SIM run mode with the tensor-graph verifier (the interpreter computes the outputs) and
    argument shape/dtype checking (``runtime_debug_mode`` 3, otherwise pypto accepts mismatches silently).
    npu: NPU run mode.
    """
    if run_mode() == "npu":
        return {"runtime_options": {"run_mode": pypto.RunMode.NPU}}
    if cost_model_only():
        return {"runtime_options": {"run_mode": pypto.RunMode.SIM}}
    return {
        "runtime_options": {"run_mode": pypto.RunMode.SIM},
        "verify_options": {"enable_pass_verify": True, "pass_verify_pass_filter": []},
        "debug_options": {"runtime_debug_mode": 3},
    }


def kernel(fn: Callable[..., Any]) -> Any:
    """Decorator: ``pypto.frontend.jit`` with this module's options."""
    return pypto.frontend.jit(**jit_options())(fn)


#: pypto keeps at most 10 iterations of a ``pypto.loop`` in flight unless ``stitch_function_max_num`` allows more
#: (the attention core's HCA case, 128 queries: 629k cycles by default, 252k with 32, 169k with 64, 148k with 128
#: or 256). pypto accepts up to 1024, but the attention core's compile ended with SIGSEGV at 166 (TINY heads,
#: 166 queries; 129 passed), so longer loops run in several stitches of 128.
MAX_STITCH = 128


def stitched_kernel(functions: int) -> Callable[[Callable[..., Any]], Any]:
    """:func:`kernel` that keeps up to ``functions`` stitch functions in flight (at most :data:`MAX_STITCH`).

    A kernel made of a loop of n iterations after some batched work needs n + 1: with n, the indexer's last
    row ran in a second stitch (+27k cycles at L = 128).
    """
    options = jit_options()
    options["runtime_options"] = {**options.get("runtime_options", {}),
                                  "stitch_function_max_num": max(1, min(functions, MAX_STITCH))}

    def decorate(fn: Callable[..., Any]) -> Any:
        return pypto.frontend.jit(**options)(fn)

    return decorate


def _shape(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(value)


@attrs.frozen
class Out:
    """An output argument the kernel must write completely: pre-filled with a sentinel, checked after the call."""

    shape: tuple[int, ...] = attrs.field(converter=_shape)
    dtype: Any = attrs.field(converter=np.dtype)
    name: str = "out"


@attrs.frozen
class LaunchResult:
    """Post-call values of every argument (``Out`` args and in/out arrays alike), and the cost-model cycles."""

    values: tuple[np.ndarray, ...]
    cycles: int | None


def sentinel(dtype: np.dtype) -> Any:
    """Fill value of unwritten outputs: NaN for floats, the dtype's minimum for integers."""
    dtype = np.dtype(dtype)
    if dtype.kind in "iu":
        return np.iinfo(dtype).min
    return np.nan


def _to_torch(array: np.ndarray) -> torch.Tensor:
    array = np.ascontiguousarray(array)
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return np.asarray(tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    return np.asarray(tensor.numpy())


def _unwritten(array: np.ndarray) -> np.ndarray:
    if array.dtype.kind in "iu":
        return np.asarray(array == np.iinfo(array.dtype).min)
    return np.isnan(array.astype(np.float32))


_CYCLES = re.compile(r"Total Cycles\.*:\s*(\d+)")


def _collect_cycles_and_clean() -> int | None:
    """Read the cost model's total cycles of the last call, then delete that call's output folder."""
    folder = Path(pypto_impl.LogTopFolder())
    cycles = None
    report = folder / "CostModelSimulationOutput" / "_simulate.stat.report.txt"
    if report.exists():
        match = _CYCLES.search(report.read_text(errors="replace"))
        cycles = int(match.group(1)) if match else None
    if folder.is_dir() and str(folder).startswith(str(SCRATCH)):
        shutil.rmtree(folder, ignore_errors=True)
    return cycles


def _pass_errors(limit: int = 8) -> str:
    """The first [ERROR] lines pypto logged for its compiler passes (they name the real cause of 'Run pass failed')."""
    lines = []
    for path in sorted((SCRATCH / "log").rglob("*.log")):
        for line in path.read_text(errors="replace").splitlines():
            if "[ERROR]" in line and "[PASS]" in line:
                lines.append(line.strip())
    return "pypto pass errors:\n" + "\n".join(lines[:limit]) if lines else "pypto logged no pass errors"


def launch(jit_kernel: Any, args: Sequence[np.ndarray | Out], *, check_written: bool = True) -> LaunchResult:
    """Call a pypto kernel on numpy arrays; inputs are copied, never mutated.

    ``args`` follows the kernel's signature. An :class:`Out` becomes a sentinel-filled buffer; after the
    call, :class:`KernelOutputError` is raised if any of its elements still holds the sentinel. Arrays are
    in/out: their post-call values are returned (a cache the kernel scatters into, for example).
    """
    tensors = []
    for arg in args:
        if isinstance(arg, Out):
            tensors.append(_to_torch(np.full(arg.shape, sentinel(arg.dtype), dtype=arg.dtype)))
        else:
            tensors.append(_to_torch(np.asarray(arg)))
    if run_mode() == "npu":
        # torch_npu is an optional NPU-only package (no stubs, absent on CPU machines); importing it
        # registers the npu device
        import torch_npu  # type: ignore[import-not-found]  # noqa: F401

        device_tensors = [t.to("npu") for t in tensors]
        jit_kernel(*device_tensors)
        torch.npu.synchronize()  # torch_npu adds torch.npu
        tensors, cycles = [t.cpu() for t in device_tensors], None
    else:
        try:
            jit_kernel(*tensors)
        except Exception as exc:
            exc.add_note(_pass_errors())
            raise
        cycles = _collect_cycles_and_clean()
    values = tuple(_to_numpy(t) for t in tensors)
    if check_written and not cost_model_only():
        for position, (arg, value) in enumerate(zip(args, values, strict=True)):
            if isinstance(arg, Out):
                missing = _unwritten(value)
                if missing.any():
                    first = np.unravel_index(int(np.flatnonzero(missing)[0]), value.shape)
                    raise KernelOutputError(
                        f"kernel {getattr(jit_kernel, '__name__', jit_kernel)!s}: output {arg.name!r} (argument "
                        f"{position}) has {int(missing.sum())} of {value.size} elements unwritten; first at index "
                        f"{tuple(int(i) for i in first)}")
    return LaunchResult(values, cycles)
