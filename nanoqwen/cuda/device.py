"""The GPU as the engine sees it: one device, one stream, raw device buffers, one `check()`.

Public API (stable; the prefill launchers and the engine build on it):

    sm90_available() -> bool            never raises; True only with cuda-core, a driver and an
                                        sm_90 device 0
    check(result, what) -> values       unwraps a cuda.bindings `(CUresult, *values)` tuple;
                                        raises DeviceError naming `what` and the error
    gpu = Gpu(device_id=0)              sets the device current, refuses non-sm_90, makes a stream
    gpu.alloc(nbytes, what) -> DeviceArray   (.ptr int, .nbytes, .free()); owned by the Gpu
    alloc_size(nbytes) -> int           the bytes gpu.alloc takes for nbytes (memory planning)
    gpu.alloc_mapped(nbytes) -> (host, device)  pinned host memory the GPU addresses directly
    gpu.upload(dst_ptr, array)          host -> device through a pinned staging buffer (chunked)
    gpu.upload_async(dst_ptr, src, n)   queue a copy from pinned host address src (no sync)
    gpu.download(src_ptr, out_array)    device -> host (synchronous)
    gpu.download_async(dst, src_ptr, n) queue a copy into pinned host address dst (no sync)
    gpu.fence(event=None) -> Event      an event recorded on the stream now (re-recorded when
                                        given); .sync() waits for the work queued before it
    gpu.memset(ptr, byte, nbytes)       stream-ordered
    gpu.launch(kernel, grid, block, *args, smem=0, pdl=False)   args: ints become uint64
                                        (device addresses); pass np.int32 etc. for scalars
    gpu.tensor_map_2d(ptr, rows, cols, box_rows, box_cols, fp16=True) -> TMA descriptor (a
                                        kernel argument) of a row-major fp16 (128-byte
                                        swizzle) or uint32 matrix
    gpu.tensor_map_3d(ptr, shape, box) -> TMA descriptor of a C-order fp16 array of 3 dims
                                        (128-byte swizzle)
    gpu.sync(what)                      stream sync inside `guard`
    gpu.stream_idle(what) -> bool       whether the stream's work is done (raises on an error)
    gpu.record() -> Event               a timing event on the stream (e1 - e0: milliseconds)
    gpu.graph_builder() -> GraphBuilder a graph being built on the stream (cuda.core)
    with gpu.guard("what"): ...         turns CUDA errors into DeviceError; a sticky error (an
                                        illegal address, a trap) marks the Gpu broken and every
                                        later call raises DeviceError at once
    gpu.mem_info() -> (free, total)

Sticky errors poison the CUDA context for the life of the process; continuing would report
garbage as results, so the engine refuses all further work instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from dataclasses import dataclass

import numpy as np

from ..errors import DeviceError

SM90 = (9, 0)
STAGING_BYTES = 64 << 20  # pinned host buffer for uploads: 64 MiB chunks keep PCIe busy
ALLOC_SLACK = 16  # readable bytes every allocation keeps past its end (Gpu.alloc)
# Errors after which the CUDA context is unusable (the driver's "sticky" errors).
STICKY_ERRORS = (
    "ILLEGAL_ADDRESS",
    "LAUNCH_FAILED",
    "MISALIGNED_ADDRESS",
    "ILLEGAL_INSTRUCTION",
    "HARDWARE_STACK_ERROR",
    "INVALID_PC",
    "ASSERT",
    "ECC_UNCORRECTABLE",
    "LAUNCH_TIMEOUT",
)


def alloc_size(nbytes: int) -> int:
    """The bytes Gpu.alloc takes for `nbytes`: rounded up to 256 with at least ALLOC_SLACK
    bytes past the end (a bulk copy of 16-byte units may read up to 14 bytes past a tensor's
    end: gemv_int4.cu's scale copies)."""
    return (int(nbytes) + ALLOC_SLACK + 255) // 256 * 256


class _CudaArray:
    """A raw device address seen through __cuda_array_interface__ (for cuda.core's views)."""

    def __init__(self, ptr: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape,
            "typestr": typestr,
            "data": (ptr, False),
            "strides": None,
            "version": 3,
        }


def sm90_available() -> bool:
    """True when cuda-core imports, a driver answers and device 0 is compute capability 9.0."""
    try:
        from cuda.bindings import driver

        (err,) = driver.cuInit(0)
        if err != driver.CUresult.CUDA_SUCCESS:
            return False
        err, count = driver.cuDeviceGetCount()
        if err != driver.CUresult.CUDA_SUCCESS or count < 1:
            return False
        attr = driver.CUdevice_attribute
        err, major = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, 0
        )
        err2, minor = driver.cuDeviceGetAttribute(
            attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, 0
        )
        ok = driver.CUresult.CUDA_SUCCESS
        return err == ok and err2 == ok and (major, minor) == SM90
    except Exception:
        return False


def check(result, what: str):
    """Unwrap a cuda.bindings result tuple `(CUresult, *values)`; raise DeviceError on failure.

    Returns None, the single value, or a tuple of values.
    """
    from cuda.bindings import driver

    if not isinstance(result, tuple):
        result = (result,)
    err, *values = result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        name = name.decode() if isinstance(name, bytes) else str(name)
        raise DeviceError(f"{what} failed: {name}")
    if not values:
        return None
    return values[0] if len(values) == 1 else tuple(values)


def _is_sticky(message: str) -> bool:
    return any(s in message for s in STICKY_ERRORS)


@dataclass
class DeviceArray:
    """A raw device allocation. `ptr` is the device address (int), `nbytes` its size."""

    ptr: int
    nbytes: int
    what: str
    _buffer: object = None  # the cuda.core Buffer that owns the memory

    def free(self) -> None:
        if self._buffer is not None:
            self._buffer.close()
            self._buffer = None


class Gpu:
    """One sm_90 device with one non-blocking stream. Not thread-safe (batch-1 runtime), but
    usable from any one thread at a time: the server builds the engine on its main thread and
    generates on a worker thread, so every entry binds the primary context to the caller."""

    def __init__(self, device_id: int = 0) -> None:
        try:
            from cuda.core import Device
        except ImportError as exc:
            raise DeviceError(f"cuda-core is not installed: {exc}") from None
        try:
            from cuda.bindings import driver

            self.device = Device(device_id)
            self.device.set_current()
            err, self._context = driver.cuCtxGetCurrent()
            check((err,), "cuCtxGetCurrent")
        except Exception as exc:
            raise DeviceError(f"cannot open CUDA device {device_id}: {exc}") from None
        cc = tuple(self.device.compute_capability)
        if cc != SM90:
            raise DeviceError(
                f"{self.device.name} is compute capability {cc[0]}.{cc[1]}; nanoqwen's kernels "
                "are built for sm_90a (H100/H200) only"
            )
        self.name = self.device.name
        self.num_sms = self.device.properties.multiprocessor_count
        self.stream = self.device.create_stream()
        self.broken: str | None = None
        self._arrays: list[DeviceArray] = []
        self._thread = threading.local()  # .bound: cuda.core's device state set on this thread
        self._thread.bound = True
        self._staging_ptr = 0
        self._mapped: list[int] = []
        self._configs: dict = {}
        self._sm_clock = None  # NVML's SM clock of this device, looked up on first use

    # -- errors -------------------------------------------------------------------------------
    def ensure_ok(self) -> None:
        """Refuse work after a sticky error; bind our context to the calling thread."""
        from cuda.bindings import driver

        if self.broken:
            raise DeviceError(
                f"the GPU hit a sticky error earlier ({self.broken}); restart the process"
            )
        if not getattr(self._thread, "bound", False):
            # cuda.core keeps per-thread device state (launch, graph capture); a thread that
            # never made the device current would initialize it mid-capture, which the driver
            # refuses (CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED).
            from cuda.core import Device

            Device(self.device.device_id).set_current()
            self._thread.bound = True
        check(driver.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    @contextlib.contextmanager
    def guard(self, what: str):
        """Run a block of CUDA work; errors become DeviceError naming `what`."""
        self.ensure_ok()
        try:
            yield
        except DeviceError as exc:
            if _is_sticky(str(exc)):
                self.broken = f"{what}: {exc}"
            raise
        except Exception as exc:  # cuda.core raises CUDAError / RuntimeError with the name
            if _is_sticky(str(exc)):
                self.broken = f"{what}: {exc}"
            raise DeviceError(f"{what} failed: {exc}") from exc

    # -- memory -------------------------------------------------------------------------------
    def alloc(self, nbytes: int, what: str) -> DeviceArray:
        """Device memory of `nbytes`, owned by this Gpu, alloc_size(nbytes) bytes of it."""
        self.ensure_ok()
        size = alloc_size(nbytes)
        try:
            buf = self.device.allocate(size, stream=self.stream)
        except Exception as exc:
            free, total = self.mem_info()
            raise DeviceError(
                f"allocating {size} bytes for {what} failed ({free} of {total} bytes free): {exc}"
            ) from None
        arr = DeviceArray(int(buf.handle), size, what, buf)
        self._arrays.append(arr)
        return arr

    def set_max_dynamic_smem(self, kernel, nbytes: int) -> None:
        """Raise a kernel's dynamic shared-memory limit (anything above 48 KiB needs this)."""
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        self._set_attribute(kernel, attr, nbytes, "MAX_DYNAMIC_SHARED_SIZE_BYTES")

    def set_smem_carveout(self, kernel, percent: int) -> None:
        """Prefer a shared-memory carveout of `percent` of the maximum for `kernel` (the rest
        of the SM's 256 KB is L1). Kernels that overlap (PDL) with different carveouts make an
        SM drain before it reconfigures; one carveout for a set of kernels keeps them
        overlapping."""
        from cuda.bindings import driver

        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
        self._set_attribute(kernel, attr, percent, "PREFERRED_SHARED_MEMORY_CARVEOUT")

    def _set_attribute(self, kernel, attr, value: int, what: str) -> None:
        from cuda.bindings import driver

        handle = kernel.handle
        if isinstance(handle, driver.CUkernel):
            dev = driver.CUdevice(self.device.device_id)
            result = driver.cuKernelSetAttribute(attr, value, handle, dev)
        else:
            result = driver.cuFuncSetAttribute(handle, attr, value)
        check(result, f"cuFuncSetAttribute({what}={value})")

    def max_active_clusters(self, kernel, grid: tuple, block: int, smem: int) -> int:
        """Clusters of `kernel` (its compile-time cluster shape) the GPU holds at once with
        `block` threads and `smem` bytes of dynamic shared memory a CTA: a cluster's CTAs share
        a GPC, so at one CTA an SM the GPCs' sizes bound it, not the SM count; a grid of more
        working clusters runs in waves (cuOccupancyMaxActiveClusters)."""
        from cuda.bindings import driver

        handle = kernel.handle
        func = handle if isinstance(handle, driver.CUfunction) else driver.CUfunction(int(handle))
        config = driver.CUlaunchConfig()
        config.gridDimX, config.gridDimY, config.gridDimZ = grid
        config.blockDimX, config.blockDimY, config.blockDimZ = block, 1, 1
        config.sharedMemBytes = smem
        with self.guard("cuOccupancyMaxActiveClusters"):
            return int(check(driver.cuOccupancyMaxActiveClusters(func, config),
                             "cuOccupancyMaxActiveClusters"))  # fmt: skip

    def live_bytes(self) -> int:
        """Bytes of this Gpu's allocations that are not freed (as rounded by alloc)."""
        return sum(a.nbytes for a in self._arrays if a._buffer is not None)

    def mem_info(self) -> tuple[int, int]:
        from cuda.bindings import driver

        return check(driver.cuMemGetInfo(), "cuMemGetInfo")

    def _staging(self) -> int:
        from cuda.bindings import driver

        if not self._staging_ptr:
            self._staging_ptr = int(check(driver.cuMemAllocHost(STAGING_BYTES), "cuMemAllocHost"))
        return self._staging_ptr

    def alloc_mapped(self, nbytes: int) -> tuple[int, int]:
        """Pinned host memory of `nbytes` mapped into the device's address space: (host
        address, device address). Kernels write it and the host reads it with no copy (the
        decode loop's token ring); freed by close()."""
        from cuda.bindings import driver

        flags = driver.CU_MEMHOSTALLOC_DEVICEMAP | driver.CU_MEMHOSTALLOC_PORTABLE
        host = int(check(driver.cuMemHostAlloc(nbytes, flags), "cuMemHostAlloc"))
        self._mapped.append(host)
        dev = int(check(driver.cuMemHostGetDevicePointer(host, 0), "cuMemHostGetDevicePointer"))
        return host, dev

    def upload(self, dst: int, array: np.ndarray) -> None:
        """Copy a host array to device address `dst` through pinned staging, in chunks."""
        from cuda.bindings import driver

        src = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        staging = self._staging()
        with self.guard("upload"):
            for start in range(0, src.nbytes, STAGING_BYTES):
                n = min(STAGING_BYTES, src.nbytes - start)
                # The previous chunk's async copy must finish before staging is overwritten.
                check(driver.cuStreamSynchronize(self.stream.handle), "cuStreamSynchronize")
                ctypes.memmove(staging, src[start : start + n].ctypes.data, n)
                check(
                    driver.cuMemcpyHtoDAsync(dst + start, staging, n, self.stream.handle),
                    "cuMemcpyHtoDAsync",
                )
            check(driver.cuStreamSynchronize(self.stream.handle), "cuStreamSynchronize")

    def upload_async(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of `nbytes` from pinned host address `src` to device address `dst` on
        the stream; the caller leaves `src` alone until the stream has passed the copy."""
        from cuda.bindings import driver

        with self.guard("upload_async"):
            check(
                driver.cuMemcpyHtoDAsync(dst, src, nbytes, self.stream.handle), "cuMemcpyHtoDAsync"
            )

    def download(self, src: int, out: np.ndarray) -> np.ndarray:
        """Copy `out.nbytes` bytes from device address `src` into `out` (synchronous)."""
        from cuda.bindings import driver

        if not out.flags.c_contiguous:
            raise ValueError("download: out must be C-contiguous")
        with self.guard("download"):
            check(driver.cuStreamSynchronize(self.stream.handle), "cuStreamSynchronize")
            check(driver.cuMemcpyDtoH(out.ctypes.data, src, out.nbytes), "cuMemcpyDtoH")
        return out

    def download_async(self, dst: int, src: int, nbytes: int) -> None:
        """Queue a copy of `nbytes` from device address `src` to pinned host address `dst` on
        the stream; `dst` holds them once a fence recorded after it has synced."""
        from cuda.bindings import driver

        with self.guard("download_async"):
            check(
                driver.cuMemcpyDtoHAsync(dst, src, nbytes, self.stream.handle), "cuMemcpyDtoHAsync"
            )

    def memset(self, ptr: int, byte: int, nbytes: int) -> None:
        from cuda.bindings import driver

        with self.guard("memset"):
            check(driver.cuMemsetD8Async(ptr, byte, nbytes, self.stream.handle), "cuMemsetD8")

    def copy_d2d(self, dst: int, src: int, nbytes: int) -> None:
        from cuda.bindings import driver

        with self.guard("copy_d2d"):
            check(driver.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream.handle), "cuMemcpyDtoD")

    # -- launches -----------------------------------------------------------------------------
    def launch(self, kernel, grid, block, *args, smem: int = 0, pdl: bool = False, stream=None):
        """Launch `kernel` (a cuda.core Kernel). Python ints are passed as uint64 addresses."""
        from cuda.core import LaunchConfig, launch

        key = (grid, block, smem, pdl)
        cfg = self._configs.get(key)
        if cfg is None:
            cfg = LaunchConfig(
                grid=grid, block=block, shmem_size=smem, programmatic_stream_serialization=pdl
            )
            self._configs[key] = cfg
        args = [np.uint64(a) if isinstance(a, int) else a for a in args]
        launch(self.stream if stream is None else stream, cfg, kernel, *args)

    def tensor_map_2d(
        self, ptr: int, rows: int, cols: int, box_rows: int, box_cols: int, *, fp16: bool = True
    ):
        """The TMA descriptor (a cuda.core TensorMapDescriptor, passed to a kernel as a
        `__grid_constant__` 128-byte parameter) of the row-major matrix [rows, cols] at device
        address `ptr`, fp16 (boxes in the 128-byte swizzle that wgmma descriptors name:
        box_cols * 2 <= 128 bytes) or, fp16=False, uint32 (boxes stored plain, row after
        row). Boxes are box_rows x box_cols; elements outside the matrix load as zeros. ptr
        and the row pitch must be multiples of 16 bytes."""
        return self._tensor_map(ptr, (rows, cols), (box_rows, box_cols), fp16)

    def tensor_map_3d(self, ptr: int, shape: tuple, box: tuple):
        """tensor_map_2d's fp16 descriptor of the C-order array `shape` (3 dims, the last
        contiguous) at `ptr`, boxes `box` in the same order: the last dimension of the box
        spans at most 128 bytes (the swizzle's), which lands as box rows of that many bytes."""
        return self._tensor_map(ptr, tuple(shape), tuple(box), True)

    def _tensor_map(self, ptr: int, shape: tuple, box: tuple, fp16: bool):
        from cuda.core._tensor_map import TensorMapL2Promotion, TensorMapSwizzle
        from cuda.core.utils import StridedMemoryView

        array = _CudaArray(ptr, tuple(shape), "<f2" if fp16 else "<u4")
        swizzle = TensorMapSwizzle.SWIZZLE_128B if fp16 else TensorMapSwizzle.NONE
        with self.guard("tensor map"):
            view = StridedMemoryView.from_cuda_array_interface(array, stream_ptr=-1)
            return view.as_tensor_map(
                box_dim=tuple(box),
                swizzle=swizzle,
                l2_promotion=TensorMapL2Promotion.L2_256B,
            )

    def sync(self, what: str = "stream synchronize") -> None:
        with self.guard(what):
            self.stream.sync()

    def stream_idle(self, what: str) -> bool:
        """True once every queued piece of work has finished, False while some runs; an
        error of that work raises DeviceError naming `what`."""
        from cuda.bindings import driver

        (err,) = driver.cuStreamQuery(self.stream.handle)
        if err == driver.CUresult.CUDA_ERROR_NOT_READY:
            return False
        with self.guard(what):
            check((err,), what)
        return True

    def record(self):
        """A timing event recorded on the stream now; `(e1 - e0)` is milliseconds after
        e1.sync()."""
        from cuda.core import EventOptions

        return self.stream.record(options=EventOptions(timing_enabled=True))

    def fence(self, event=None):
        """An event (no timing) recorded on the stream now, or `event` re-recorded (no new
        driver object per use); `.sync()` returns once the work queued before it is done."""
        return self.stream.record(event)

    def sm_clock_mhz(self) -> int | None:
        """The SM clock now, in MHz (NVML, through cuda.core.system; thread-safe), or None
        where NVML cannot tell (no driver library, a virtualized device): the clock is a
        measurement's context, never a reason to fail one."""
        try:
            if self._sm_clock is None:
                self._sm_clock = self.device.to_system_device().get_clock("sm")
            return int(self._sm_clock.get_current_mhz())
        except Exception:
            return None

    def graph_builder(self):
        """A cuda.core GraphBuilder capturing onto the stream (begin_building() called)."""
        return self.stream.create_graph_builder().begin_building()

    def close(self) -> None:
        from cuda.bindings import driver

        for arr in self._arrays:
            with contextlib.suppress(Exception):
                arr.free()
        self._arrays.clear()
        for host in [self._staging_ptr, *self._mapped]:
            if host:
                with contextlib.suppress(Exception):
                    driver.cuMemFreeHost(host)
        self._staging_ptr = 0
        self._mapped.clear()
