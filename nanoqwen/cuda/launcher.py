"""What the decode and prefill launchers share: compile and load a set of registry specs, and
one launch path that every kernel goes through.

Construction compiles the specs' sources with NVRTC (through the disk cache; nothing is built
twice), loads them on the Gpu's device and raises each kernel's dynamic shared-memory limit
to its spec's. After that a launch only checks what Python can check and enqueues: no
compilation, no allocation.

`on_launch`: set it to a callable and every launch is reported to it, after it is enqueued,
as a `Launch` (bench --kernels records a decode step that way and replays it kernel by
kernel; dev/ttft_profile.py records an event after each prefill launch).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..config import ModelConfig
from . import registry
from .device import Gpu


@dataclass(frozen=True)
class Launch:
    """One kernel launch: `label` names the op ("gemv gate_up", "attention"); what it must
    read from memory at minimum is `nbytes` + `per_token` x the context length (attention
    reads every cached token's K and V; the length lives on the device)."""

    label: str
    kernel: object
    grid: tuple
    block: int
    args: tuple
    smem: int
    nbytes: int = 0
    per_token: int = 0


class Launcher:
    """The kernels of `specs` compiled for `config` and `geometry`, loaded on `gpu`.

    pdl: launch with programmatic stream serialization. Every kernel calls
    griddepcontrol.wait before it reads what an earlier kernel wrote, so correctness does not
    depend on the flag; the launch overlap does.
    """

    def __init__(
        self,
        gpu: Gpu,
        config: ModelConfig,
        specs: Iterable[registry.KernelSpec],
        geometry: registry.Geometry = registry.DEFAULT_GEOMETRY,
        *,
        pdl: bool = True,
    ) -> None:
        self.gpu, self.config, self.geometry, self.pdl = gpu, config, geometry, pdl
        self.specs = {s.key: s for s in specs}
        modules = registry.compile_specs(self.specs.values(), config, geometry)
        self.resources = {}  # ptxas -v, by name expression
        for mod in modules.values():
            self.resources.update(mod.resources())
        self._modules = modules  # the loaded images live as long as their kernels are used
        self.kernels = {}
        with gpu.guard(f"loading {', '.join(modules)}"):
            for key, spec in self.specs.items():
                kernel = modules[spec.source].kernel(spec.expression)
                if spec.smem:
                    gpu.set_max_dynamic_smem(kernel, spec.smem)
                self.kernels[key] = kernel
        self.on_launch: Callable[[Launch], None] | None = None

    def ctas_per_sm(self, key: str) -> int:
        """CTAs of kernel `key` resident per SM at its block and shared memory (at least 1)."""
        spec = self.specs[key]
        occupancy = self.kernels[key].occupancy
        return max(1, occupancy.max_active_blocks_per_multiprocessor(spec.threads, spec.smem))

    def launch(self, key: str, grid: tuple, *args, stream=None, label: str = "", nbytes: int = 0,
               per_token: int = 0) -> None:  # fmt: skip
        """Enqueue kernel `key` on `stream` (a cuda.core Stream or a GraphBuilder being built;
        None: the Gpu's stream) with its spec's block and shared memory. Python ints in
        `args` are device addresses (uint64); pass np.int32 etc. for scalars."""
        spec, kernel = self.specs[key], self.kernels[key]
        self.gpu.launch(kernel, grid, spec.threads, *args, smem=spec.smem, pdl=self.pdl,
                        stream=stream)  # fmt: skip
        if self.on_launch is not None:
            self.on_launch(Launch(label or key, kernel, grid, spec.threads, args, spec.smem,
                                  nbytes, per_token))  # fmt: skip

    def replay(self, launch: Launch, stream=None) -> None:
        """Enqueue a recorded launch again, unreported."""
        self.gpu.launch(launch.kernel, launch.grid, launch.block, *launch.args,
                        smem=launch.smem, pdl=self.pdl, stream=stream)  # fmt: skip
