"""CI (no GPU): every decode kernel compiles with NVRTC for sm_90a without spills, `nanoqwen
kernels` reports every kernel of the registry, the cache is honest (a hit returns the same
cubin; NANOQWEN_NO_COMPILE turns a miss into an error), and the generated header is the one
home of the model's dims, the geometry and the contract's enums."""

import re
import sys

import pytest

from nanoqwen.config import preset
from nanoqwen.cuda import jit, registry
from nanoqwen.errors import DeviceError

pytest.importorskip("cuda.bindings.nvrtc")

REPO = jit.KERNEL_DIR.parents[1]


@pytest.fixture(autouse=True)
def _cache(kernel_cache):
    return kernel_cache


@pytest.mark.parametrize("name", ["7b", "tiny"])
def test_kernels_command_reports_every_kernel(name, capsys):
    from nanoqwen.cli import main

    assert main(["kernels", "--model", name]) == 0
    out = capsys.readouterr().out
    specs = registry.kernel_table(preset(name))
    assert {s.source for s in specs} >= {registry.PREFILL_GEMM, registry.PREFILL_ATTENTION}
    for s in specs:
        assert s.expression in out
    assert "SPILLS" not in out and "kGvStageTarget=8192" in out


def test_kernels_command_with_an_override(capsys):
    from nanoqwen.cli import main

    assert main(["kernels", "--model", "tiny", "--set", "kGvEarlyStages=2"]) == 0
    assert "kGvEarlyStages=2" in capsys.readouterr().out
    assert main(["kernels", "--model", "tiny", "--set", "kNoSuchThing=1"]) == 2
    assert "unknown geometry names ['kNoSuchThing']" in capsys.readouterr().err


def test_kernels_command_without_nvrtc(monkeypatch, capsys):
    from nanoqwen.cli import main

    monkeypatch.setitem(sys.modules, "cuda.bindings.nvrtc", None)  # import raises ImportError
    assert main(["kernels", "--model", "tiny"]) == 2
    assert "pip install 'nanoqwen[cuda]'" in capsys.readouterr().err


def test_decode_resources():
    cfg = preset("7b")
    specs = registry.decode_specs(cfg)
    res = registry.compile_specs(specs, cfg)[registry.GEMV].resources()
    assert len(res) == 4
    for r in res.values():  # two CTAs of 288 threads an SM leave 96 registers a thread
        assert r.registers > 0 and r.spill_bytes == 0 and r.registers <= 96


def test_cache_hit_and_no_compile(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOQWEN_CACHE", str(tmp_path))
    header = registry.header(preset("tiny"))
    a = jit.compile_module("decode_misc.cu", ["embed_gather"], header)
    monkeypatch.setenv("NANOQWEN_NO_COMPILE", "1")
    b = jit.compile_module("decode_misc.cu", ["embed_gather"], header)  # a hit: allowed
    assert a.cubin == b.cubin
    with pytest.raises(DeviceError, match="NANOQWEN_NO_COMPILE"):
        jit.compile_module("decode_misc.cu", ["embed_gather"], registry.header(preset("1.5b")))
    other = registry.header(preset("tiny"), registry.Geometry().override({"kMiscThreads": 128}))
    with pytest.raises(DeviceError, match="NANOQWEN_NO_COMPILE"):  # a geometry is a new entry
        jit.compile_module("decode_misc.cu", ["embed_gather"], other)


def test_compile_error_names_file():
    with pytest.raises(DeviceError, match="broken.cu"):
        jit.compile_module(
            "broken.cu",
            ["k"],
            registry.header(None),
            source='extern "C" __global__ void k() { x; }',
        )


def test_header():
    text = registry.header(preset("7b"))
    assert "constexpr int kHidden = 3584;" in text
    assert "constexpr int kKVHeads = 4;" in text
    assert "kRopeTheta = 1000000.0f" in text
    assert "constexpr int kGvThreads = 288;" in text and "constexpr int kAttnThreads = 160;" in text
    assert "  kEos0 = 11," in text and "constexpr int kMaxEos = 8;" in text
    assert "  kSwiGLU = 2," in text
    assert registry.STATE_WORDS == registry.StateWord.EOS0 + registry.MAX_EOS


def test_geometry_override():
    g = registry.Geometry().override({"kAttnStages": 8, "kGvEarlyStages": 0})
    assert (g.attn_stages, g.gv_early_stages) == (8, 0)
    assert "constexpr int kAttnStages = 8;" in registry.header(None, g)
    with pytest.raises(ValueError, match="unknown geometry names"):
        registry.Geometry().override({"kAttnStage": 8})


def test_no_constant_is_mirrored():
    """Every name the generated header declares has that one home: no kernel source defines a
    constexpr or an enumerator of the same name, and no Python module but the registry defines
    a module constant for a geometry value or a state word."""
    text = registry.header(preset("7b"))
    names = set(re.findall(r"constexpr \w+ (k\w+) =", text)) | set(
        re.findall(r"^  (k\w+) =", text, re.M)
    )
    assert {"kHidden", "kGvStageTarget", "kTemp", "kSwiGLU", "kPageTokens"} <= names
    for path in sorted(jit.KERNEL_DIR.glob("*.cu*")):
        source = path.read_text()
        for name in names:
            assert not re.search(rf"constexpr\s+\w+\s+{name}\s*=", source), f"{path.name}: {name}"
            assert not re.search(rf"^\s*{name}\s*=", source, re.M), f"{path.name}: {name}"
    fields = [f.upper() for f in registry.Geometry.__dataclass_fields__]
    words = [f"S_{w.name}" for w in registry.StateWord]
    old = ["GEMV_THREADS", "GEMV_SMEM", "GEMV_CTAS_PER_SM", "ATTN_THREADS", "NORM_ROWS",
           "STATE_WORDS", "MAX_EOS", "PAGE_TOKENS"]  # fmt: skip
    defined = re.compile(rf"^({'|'.join(fields + words + old)})\s*[:=]", re.M)
    homes = {"registry.py", "config.py"}  # the geometry and the contract; PAGE_TOKENS
    for path in sorted((REPO / "nanoqwen").rglob("*.py")):
        if path.name not in homes:
            assert not defined.search(path.read_text()), (
                f"{path}: {defined.search(path.read_text())}"
            )


def test_sm90_available_never_raises():
    from nanoqwen.cuda.device import sm90_available

    assert sm90_available() in (True, False)


def test_dev_probe_kernels_compile():
    """dev/decode_probes.cu (the playground's probe kernels) builds without spills: every
    extern "C" kernel it defines."""
    path = REPO / "dev" / "decode_probes.cu"
    text = path.read_text()
    names = re.findall(r'extern "C" __global__ void(?: __launch_bounds__\([^)]*\))?\s+(\w+)', text)
    assert names, "no kernels found"
    res = jit.compile_module(path.name, names, registry.header(None), source=text).resources()
    assert set(res) == set(names)
    assert all(r.spill_bytes == 0 for r in res.values())
