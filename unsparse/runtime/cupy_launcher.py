"""Loading ``kernels/*.cu`` through CuPy and launching on torch tensors without copies.

The launches (grid, block, instantiation, shared memory) come from :mod:`unsparse.runtime.launch_geometry`.
CuPy is imported lazily; importing this module needs neither CuPy nor a GPU.

Tensors reach a kernel as their device pointers (zero copy), after a check of device and contiguity, on
torch's current stream. A DLPack hand-over per argument (``cupy.from_dlpack``) cost about 0.3 ms of host
time per launch, which set a 0.32 ms floor under every small layer in the H100 benchmark of 2026-11-23. A launch
is bound once (:func:`bind`: function handle, shared-memory opt-in, the parameter block with the fixed arguments
converted) and then called with the pointers that change from call to call, straight through ``cuLaunchKernel``.
"""

from __future__ import annotations

import ctypes
import functools
import operator
import threading
from pathlib import Path
from typing import Any

import torch

from unsparse.runtime.launch_geometry import SHARED_LIMIT_BYTES, Launch

KERNEL_DIR = Path(__file__).resolve().parents[2] / "kernels"
"""The repository's ``kernels/`` folder, located relative to this package."""

KERNEL_FILE = KERNEL_DIR / "direct_conv.cu"
COMPILE_OPTIONS = ("-std=c++17",)


@functools.cache
def _source() -> str:
    return KERNEL_FILE.read_text()


@functools.cache
def get_kernel(name: str) -> Any:
    """The compiled ``cupy.RawKernel`` for one template instantiation, compiled once per process.

    CuPy also keeps compiled modules in its on-disk cache, so a second process skips NVRTC.

    Raises:
        ImportError: without CuPy.
    """
    import cupy

    module = cupy.RawModule(code=_source(), options=COMPILE_OPTIONS, name_expressions=[name])
    return module.get_function(name)


def precompile(names: list[str], workers: int = 16) -> None:
    """Compile several instantiations concurrently (NVRTC runs outside the GIL); each is then cached."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=workers) as pool:
        list(pool.map(get_kernel, names))


def device_pointer(arg: torch.Tensor | None, device: torch.device, position: int) -> int:
    """A pointer argument's value: a tensor's data pointer (zero copy), or 0 for None.

    Raises:
        ValueError: naming the kernel parameter ``position``, for a tensor on another device or not contiguous
            (the kernels index it densely), or anything else.
    """
    if arg is None:
        return 0
    if not isinstance(arg, torch.Tensor):
        raise ValueError(f"kernel argument {position}: expected a tensor or None, got {type(arg).__name__}")
    if arg.device != device:
        raise ValueError(f"kernel argument {position}: tensor on {arg.device}, launch on {device}")
    if not arg.is_contiguous():
        raise ValueError(f"kernel argument {position}: tensor is not contiguous")
    return arg.data_ptr()


def kernel_parameter(arg: Any, device: torch.device, position: int) -> ctypes.c_uint64 | ctypes.c_int32:
    """One kernel argument as ``cuLaunchKernel`` copies it: tensors and None as 64-bit device pointers
    (:func:`device_pointer`), integers (anything ``operator.index`` takes, numpy's included) as int32 (the kernels'
    index and size parameters).

    Raises:
        ValueError: naming the parameter ``position``: from :func:`device_pointer`, or an integer that does not fit
            int32.
    """
    if arg is None or isinstance(arg, torch.Tensor):
        return ctypes.c_uint64(device_pointer(arg, device, position))
    try:
        value = operator.index(arg)
    except TypeError:
        raise ValueError(f"kernel argument {position}: expected a tensor, None or an integer, got "
                         f"{type(arg).__name__}") from None
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"kernel argument {position}: {value} does not fit int32")
    return ctypes.c_int32(value)


class PerCall:
    """The type of :data:`PER_CALL`."""

    def __repr__(self) -> str:
        return "PER_CALL"


PER_CALL = PerCall()
"""Marks, in the arguments given to :func:`bind`, a pointer parameter that each call of the bound launch fills (the
input, the bias, the output: what changes from call to call)."""


class KernelParameters:
    """The parameter block a bound launch hands ``cuLaunchKernel``: one ctypes value per kernel parameter, the fixed
    ones converted once (:func:`kernel_parameter`), and the array of their addresses (``kernelParams``, which the
    driver reads at launch time, so the block is reused from call to call). :data:`PER_CALL` positions are pointer
    ``slots`` that :meth:`fill` sets.

    Raises:
        ValueError: from :func:`kernel_parameter`, for a fixed argument, naming its position.
    """

    def __init__(self, args: tuple[Any, ...], device: torch.device) -> None:
        self.values = tuple(ctypes.c_uint64(0) if arg is PER_CALL else kernel_parameter(arg, device, position)
                            for position, arg in enumerate(args))
        self.slots = tuple(position for position, arg in enumerate(args) if arg is PER_CALL)
        self._slot_values = tuple(self.values[position] for position in self.slots)
        self._addresses = (ctypes.c_void_p * max(1, len(args)))(*(ctypes.addressof(v) for v in self.values))

    @property
    def address(self) -> int:
        """The address of the ``void*`` array (``kernelParams``)."""
        return ctypes.addressof(self._addresses)

    def fill(self, values: tuple[torch.Tensor | None, ...], device: torch.device) -> None:
        """Set the slots, in order, to ``values``' device pointers (:func:`device_pointer`).

        Raises:
            ValueError: for a count of values other than the slots', or from :func:`device_pointer`.
        """
        if len(values) != len(self.slots):
            raise ValueError(f"kernel arguments: {len(values)} per-call values for {len(self.slots)} slots")
        for slot, position, value in zip(self._slot_values, self.slots, values, strict=True):
            slot.value = device_pointer(value, device, position)


def current_stream(device: torch.device) -> int:
    """The ``cudaStream_t`` of torch's current stream on ``device``, what a :class:`BoundLaunch` launches on. Look it
    up once per layer call and pass it to each of the call's launches."""
    return torch.cuda.current_stream(device).cuda_stream


class BoundLaunch:
    """One launch resolved once (:func:`bind`): the compiled instantiation's function handle, opted in to its
    dynamic shared memory, and its parameter block with every argument but the per-call ones converted. A call
    sets the per-call pointers and calls ``cuLaunchKernel`` itself (``cupy.cuda.driver.launchKernel``): CuPy's
    kernel call converted every argument again and entered device and stream contexts: about 40 % of the direct
    stem call's host time in the fifteenth session's cProfile (kernels/NOTES.md, sixteenth session).

    Attributes:
        spec: grid, block, instantiation and dynamic shared memory.
        device: the CUDA device the fixed tensors live on and the kernel runs on.
        parameters: the parameter block with its per-call slots.
        fixed: the fixed tensor arguments, kept alive as long as the binding, since their pointers are baked in.
    """

    def __init__(self, spec: Launch, device: torch.device, parameters: KernelParameters, function: Any,
                 fixed: tuple[torch.Tensor, ...]) -> None:
        import cupy

        self.spec, self.device, self.parameters, self.fixed = spec, device, parameters, fixed
        self._function = function  # the cupy Function: keeps its module loaded while its handle is used
        self._handle = function.ptr
        self._cuda_device = cupy.cuda.Device(device.index)
        self._launch = cupy.cuda.driver.launchKernel
        self._lock = threading.Lock()  # one parameter block: two threads must not fill it at once

    def __call__(self, stream: int, *values: torch.Tensor | None) -> None:
        """Run on ``stream`` (a ``cudaStream_t``, :func:`current_stream`) with ``values`` in the per-call slots, in
        order. Tensors must stay alive until the kernel has run, as with any asynchronous torch operation on the
        stream.

        Raises:
            ValueError: from :meth:`KernelParameters.fill`.
            cupy.cuda.driver.CUDADriverError: if the driver refuses the launch.
        """
        spec = self.spec
        with self._lock, self._cuda_device:
            _ensure_context(self.device.index)
            self.parameters.fill(values, self.device)
            self._launch(self._handle, *spec.grid, *spec.block, spec.shared_bytes, stream,
                         self.parameters.address, 0)


_THREAD_CONTEXTS = threading.local()
"""Per thread, the device indices whose primary context this module made current on it (:func:`_ensure_context`)."""


def _ensure_context(device_index: int) -> None:
    """Make device ``device_index``'s primary context current on this thread (the current device), once per thread
    and device. ``cuLaunchKernel`` launches in the thread's current driver context, and a thread whose first CUDA
    work is a bound launch has none (``CUDA_ERROR_INVALID_CONTEXT``); a runtime call that needs the context
    (``cudaMemGetInfo``, as CuPy's own launches do) sets it, and torch's calls on that device then share it."""
    made = getattr(_THREAD_CONTEXTS, "devices", None)
    if made is None:
        made = _THREAD_CONTEXTS.devices = set()
    if device_index not in made:
        import cupy

        cupy.cuda.runtime.memGetInfo()
        made.add(device_index)


def bind(spec: Launch, args: tuple[Any, ...], device: torch.device) -> BoundLaunch:
    """Resolve one launch for repeated calls on ``device``.

    Args:
        spec: from one of the ``*_launch`` functions of :mod:`unsparse.runtime.launch_geometry` (rows, tile,
            pointwise, pairing, phase pairing).
        args: kernel arguments in declaration order (:func:`kernel_parameter`), :data:`PER_CALL` where each call
            gives a pointer.

    Raises:
        ImportError: without CuPy.
        ValueError: from :func:`kernel_parameter`, for a fixed argument.
    """
    import cupy

    parameters = KernelParameters(args, device)
    kernel = get_kernel(spec.name)
    with cupy.cuda.Device(device.index):
        if spec.shared_bytes > SHARED_LIMIT_BYTES:
            _opt_in(spec.name, spec.shared_bytes, device.index)
        function = kernel.kernel  # this device's handle (compiled or loaded here on first use)
    return BoundLaunch(spec, device, parameters, function,
                       tuple(arg for arg in args if isinstance(arg, torch.Tensor)))


_OPTED_IN: dict[tuple[str, int], int] = {}
"""Dynamic shared memory each (instantiation, device) may take so far, bytes (:func:`_opt_in`)."""


def _opt_in(name: str, shared_bytes: int, device_index: int) -> None:
    """Let instantiation ``name`` take at least ``shared_bytes`` of dynamic shared memory on the current device
    (CUDA's ``MAX_DYNAMIC_SHARED_SIZE_BYTES`` function attribute; needed beyond :data:`SHARED_LIMIT_BYTES`). The
    attribute only grows: a ``stage_entries`` tiling's shared memory depends on the weight
    (:func:`~unsparse.runtime.launch_geometry.tile_shared_bytes`), so one instantiation is bound with several sizes,
    and lowering it would make the launches bound before fail with ``CUDA_ERROR_INVALID_VALUE``."""
    key = (name, device_index)
    if shared_bytes > _OPTED_IN.get(key, 0):
        get_kernel(name).max_dynamic_shared_size_bytes = shared_bytes
        _OPTED_IN[key] = shared_bytes
