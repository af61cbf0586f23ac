"""Device memory planning on the CPU (nanoqwen/engine/memory.py): every preset at its 32k
context fits an H200, a model that does not fit is refused with needed against free bytes
and the longest context that would fit, and the plan is what the engine's load allocates, to
the byte, for the parts that a fake Gpu can build (weights, KV cache, decode buffers,
prefill scratch; PrefillKernels' workspace needs a GPU: tests/test_gpu_engine.py)."""

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from nanoqwen.config import PRESETS, preset
from nanoqwen.cuda import registry
from nanoqwen.cuda.decode import DecodeKernels
from nanoqwen.cuda.device import DeviceArray, alloc_size
from nanoqwen.engine import memory
from nanoqwen.engine.decode_loop import DecodeLoop
from nanoqwen.engine.forward import Forward
from nanoqwen.engine.kv_cache import KVCache
from nanoqwen.engine.weights import upload_weights
from nanoqwen.errors import DeviceError
from nanoqwen.fileformat import NanoqwenFile

GIB = 1 << 30


@pytest.mark.parametrize("name", [n for n in PRESETS if n != "tiny"])
def test_every_preset_fits_an_h200_at_32k(name):
    cfg = preset(name)
    plan = memory.check_memory(cfg, 32768, memory.H200_FREE, 141 * 10**9)
    assert plan.needed <= memory.H200_FREE
    assert set(plan.parts) == {"weights", "kv_cache", "prefill_scratch", "prefill_workspace",
                               "decode_buffers", "margin"}  # fmt: skip
    # K as an fp16 (hi, lo) pair and V in fp16, + the padding page
    kv = cfg.num_layers * 3 * (32768 + 16) * cfg.kv_size * 2
    assert kv <= plan.parts["kv_cache"] <= kv + 2 * cfg.num_layers * 512 + 4 * 2048 + 512
    # INT4 (half a byte a weight, a fp16 scale a 128) + fp16 embeddings and lm_head
    assert plan.parts["weights"] >= cfg.weight_bytes_per_token()


def test_the_32b_at_32k():
    plan = memory.plan_memory(preset("32b"), 32768)
    p = {k: v / GIB for k, v in plan.parts.items()}
    assert 17.5 < p["weights"] < 18.5  # 64 layers of INT4 + 2 x 152064 x 5120 fp16
    assert p["kv_cache"] == pytest.approx(12.0, abs=0.01)  # 64 x 3 x 32768 x 8 x 128 x 2 bytes
    # ~142 KB a token of a 32k prompt (20 KB: the fp32 residual, 28 KB: the fp32 q/k/v)
    assert 4.3 < p["prefill_scratch"] < 4.5
    assert plan.needed < 36 * GIB < memory.H200_FREE
    assert plan.describe().startswith(f"{plan.needed / GIB:.2f} GiB = weights 17.")


def test_refused_with_needed_against_free():
    cfg, free, total = preset("32b"), 24 * GIB, 80 * GIB  # a GPU mostly taken by another job
    with pytest.raises(DeviceError) as err:
        memory.check_memory(cfg, 32768, free, total)
    needed = memory.plan_memory(cfg, 32768).needed
    largest = memory.largest_context(cfg, free)
    msg = str(err.value)
    assert f"the 32b at max_context 32768 needs {needed} bytes" in msg
    assert f"but {free} of {total} bytes (24.00 of 80.00 GiB) are free" in msg
    assert "weights 17." in msg and "kv_cache 12.01" in msg
    assert f"max_context {largest} would fit" in msg
    assert memory.plan_memory(cfg, largest).needed <= free
    assert memory.plan_memory(cfg, largest + 1).needed > free
    memory.check_memory(cfg, largest, free, total)  # no error


def test_nothing_fits():
    with pytest.raises(DeviceError, match="no context fits"):
        memory.check_memory(preset("32b"), 1, 16 * GIB, 16 * GIB)
    assert memory.largest_context(preset("32b"), 16 * GIB) == 0


def test_the_plan_grows_with_the_context_and_the_sms():
    cfg = preset("7b")
    a, b = memory.plan_memory(cfg, 4096), memory.plan_memory(cfg, 8192)
    assert a.parts["weights"] == b.parts["weights"] and a.needed < b.needed
    assert (
        memory.plan_memory(cfg, 4096, 114).parts["prefill_workspace"]
        < (a.parts["prefill_workspace"])
    )


class FakeGpu:
    """Gpu's allocation surface on the host: alloc rounds as Gpu.alloc does; uploads land in
    host bytes; mapped memory is a host buffer."""

    num_sms = memory.H200_SMS

    def __init__(self):
        self.arrays, self.data, self._host = [], {}, []
        self.next = 1 << 20

    def alloc(self, nbytes, what):
        size = alloc_size(nbytes)
        arr = DeviceArray(self.next, size, what, SimpleNamespace(close=lambda: None))
        self.next += size
        self.arrays.append(arr)
        return arr

    def live_bytes(self):
        return sum(a.nbytes for a in self.arrays if a._buffer is not None)

    def upload(self, ptr, array):
        self.data[ptr] = np.ascontiguousarray(array).tobytes()

    def memset(self, ptr, byte, nbytes):
        pass

    def alloc_mapped(self, nbytes):
        buf = (ctypes.c_char * nbytes)()
        self._host.append(buf)
        return ctypes.addressof(buf), 0


def test_the_plan_is_what_the_load_allocates(tmp_path, files):
    """Weights, KV cache, decode buffers and the prefill scratch of a max_context prompt, as
    CudaBackend builds them, against plan_memory's parts."""
    cfg, ctx = files.TIED, 1000
    path = tmp_path / "m.nanoqwen"
    tensors = files.write_model(path, cfg)
    plan, gpu = memory.plan_memory(cfg, ctx, FakeGpu.num_sms).parts, FakeGpu()
    with NanoqwenFile(path) as f:
        weights = upload_weights(gpu, f)
    assert gpu.live_bytes() == weights.nbytes == plan["weights"]
    qkv = [tensors[f"layers.1.{p}.qweight"] for p in ("q_proj", "k_proj", "v_proj")]
    assert gpu.data[weights.layers[1].qkv_w] == np.concatenate(qkv).tobytes()
    assert weights.lm_head == weights.embed  # tied: uploaded once

    before = gpu.live_bytes()
    kv = KVCache(gpu, cfg, ctx, registry.DEFAULT_GEOMETRY.k_parts)
    assert gpu.live_bytes() - before == plan["kv_cache"]
    before = gpu.live_bytes()
    kernels = SimpleNamespace(config=cfg, geometry=registry.DEFAULT_GEOMETRY, gpu=gpu)
    kernels.attention_scratch = lambda: DecodeKernels.attention_scratch(kernels)
    loop = DecodeLoop(gpu, kernels, ctx)
    forward = Forward(gpu, cfg, kernels, None, weights, kv, loop, ctx)
    assert gpu.live_bytes() - before == plan["decode_buffers"]
    before = gpu.live_bytes()
    forward.scratch(17)
    forward.scratch(ctx)  # the 17-token scratch is freed, the max_context one kept
    assert gpu.live_bytes() - before == plan["prefill_scratch"]


def test_memory_command(capsys):
    from nanoqwen.cli import main

    assert main(["memory", "--model", "32b"]) == 0
    out = capsys.readouterr().out
    assert "kv_cache" in out and "fits; the longest context that fits: 32768" in out
    assert main(["memory", "--model", "32b", "--free-gib", "24"]) == 1
    largest = memory.largest_context(preset("32b"), 24 * GIB, max_batch=16)  # the default
    assert f"does NOT fit; the longest context that fits: {largest}" in capsys.readouterr().out
    assert main(["memory", "--model", "32b", "--context", "40000"]) == 2
    assert "max_position_embeddings" in capsys.readouterr().err
