"""CI (no GPU): every decode kernel compiles with NVRTC for sm_90a without spills, the cache
is honest (a hit returns the same cubin; NANOQWEN_NO_COMPILE turns a miss into an error), and
the generated header carries the config's dims."""

import pytest

from nanoqwen.config import preset
from nanoqwen.cuda import jit
from nanoqwen.errors import DeviceError

pytest.importorskip("cuda.bindings.nvrtc")


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path_factory.getbasetemp() / "kcache"))


@pytest.mark.parametrize("name", ["7b", "tiny"])
def test_kernels_command(name, capsys):
    from nanoqwen.cli import main

    assert main(["kernels", "--model", name]) == 0
    out = capsys.readouterr().out
    for names in jit.decode_kernels(preset(name)).values():
        for n in names:
            assert n in out
    assert "SPILLS" not in out


def test_resources_parsed():
    mods = jit.compile_decode(preset("7b"))
    res = mods["gemv_int4.cu"].resources()
    assert len(res) == 4
    for r in res.values():
        assert r.registers > 0 and r.spill_bytes == 0 and r.registers <= 128


def test_cache_hit_and_no_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    cfg = preset("tiny")
    a = jit.compile_module("decode_misc.cu", ["embed_gather"], cfg)
    monkeypatch.setenv("NANOQWEN_NO_COMPILE", "1")
    b = jit.compile_module("decode_misc.cu", ["embed_gather"], cfg)  # a hit: allowed
    assert a.cubin == b.cubin
    with pytest.raises(DeviceError, match="NANOQWEN_NO_COMPILE"):
        jit.compile_module("decode_misc.cu", ["embed_gather"], preset("1.5b"))  # a miss


def test_compile_error_names_file():
    with pytest.raises(DeviceError, match="broken.cu"):
        jit.compile_module("broken.cu", ["k"], None, source='extern "C" __global__ void k() { x; }')


def test_model_header():
    text = jit.model_header(preset("7b"))
    assert "constexpr int kHidden = 3584;" in text
    assert "constexpr int kKVHeads = 4;" in text
    assert "kRopeTheta = 1000000.0f" in text


def test_sm90_available_never_raises():
    from nanoqwen.cuda.device import sm90_available

    assert sm90_available() in (True, False)


def test_launcher_constants_match_the_kernels():
    """kernels.py's block sizes and rings repeat constexpr values of the .cu files (a launch
    with more threads than __launch_bounds__ fails; fewer skips rows): they must agree."""
    import re

    from nanoqwen.cuda import kernels

    pairs = {
        "decode_misc.cu": {
            "kMiscThreads": kernels.MISC_THREADS,
            "kLmWarps": kernels.LM_WARPS,
            "kLmMaxSlots": kernels.LM_MAX_SLOTS,
            "kSampleThreads": kernels.SAMPLE_THREADS,
        },
        "gemv_int4.cu": {"kGvCtasPerSm": kernels.GEMV_CTAS_PER_SM},
    }
    for source, names in pairs.items():
        text = (jit.KERNEL_DIR / source).read_text()
        for name, value in names.items():
            found = re.search(rf"constexpr int {name} = (\d+);", text)
            assert found, f"{source}: no constexpr int {name}"
            assert int(found.group(1)) == value, f"{source} {name} = {found.group(1)}, not {value}"


def test_decode_probes_compile():
    """tools/decode_probes.py's probe kernels build without spills, at the block size the tool
    launches."""
    import importlib.util
    from pathlib import Path

    tool = Path(__file__).parents[1] / "tools" / "decode_probes.py"
    spec = importlib.util.spec_from_file_location("decode_probes", tool)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    src = tool.with_suffix(".cu").read_text()
    assert f"constexpr int kProbeThreads = {mod.THREADS};" in src
    names = ["probe_link", "probe_persist", "probe_stream"]
    res = jit.compile_module(tool.with_suffix(".cu").name, names, source=src).resources()
    assert set(res) == set(names)
    assert all(r.spill_bytes == 0 for r in res.values())
