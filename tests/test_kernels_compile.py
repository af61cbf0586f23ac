"""CI (no GPU): every kernel of every preset compiles with NVRTC for sm_90a without spills
(`nanoqwen kernels` reports each one), every GEMV's ring holds two stages on an H100's or an
H200's grid, the cache is honest (a hit returns the same
cubin; NANOQWEN_NO_COMPILE turns a miss into an error), and the generated header is the one
home of the model's dims, the geometry and the contract's enums."""

import re
import sys

import pytest

from nanoqwen.config import PRESETS, preset
from nanoqwen.cuda import jit, registry
from nanoqwen.errors import DeviceError

pytest.importorskip("cuda.bindings.nvrtc")

REPO = jit.KERNEL_DIR.parents[1]


@pytest.fixture(autouse=True)
def _cache(kernel_cache):
    return kernel_cache


@pytest.mark.parametrize("name", list(PRESETS))
def test_kernels_command_reports_every_kernel(name, capsys):
    from nanoqwen.cli import main

    assert main(["kernels", "--model", name]) == 0
    out = capsys.readouterr().out
    specs = registry.kernel_table(preset(name))
    assert {s.source for s in specs} >= {registry.PREFILL_GEMM, registry.PREFILL_ATTENTION}
    for s in specs:
        assert s.expression in out
    assert "SPILLS" not in out and "kGvStageTarget=8192" in out


@pytest.mark.parametrize("name", ["0.5b", "7b"])
def test_kernels_with_the_plain_fp16_k_cache(name, capsys):
    """The other K cache format (registry.K_CACHE): one tile of K a page, the rings' stages
    for the same bytes, no spills (head dims 64 and 128)."""
    from nanoqwen.cli import main

    assert main(["kernels", "--model", name, "--k-cache", "fp16"]) == 0
    out = capsys.readouterr().out
    assert "SPILLS" not in out and "kKParts=1" in out and "kAttnStages=12" in out


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


@pytest.mark.parametrize("name", ["7b", "32b"])
def test_gemv_resources(name):
    """Two CTAs of 9 warps an SM, or one of 17 (the wide form), leave 96 registers a thread:
    five warps share an SM quarter's 16K."""
    cfg = preset(name)
    specs = [s for s in registry.decode_specs(cfg) if s.source == registry.GEMV]
    res = registry.compile_specs(specs, cfg)[registry.GEMV].resources()
    assert len(res) == 4
    for s in specs:
        form, r = registry.gemv_form(s.targs[0]), res[s.expression]
        assert s.threads == form.threads and s.smem == form.smem <= 227 * 1024
        assert r.registers > 0 and r.spill_bytes == 0 and r.registers <= 96, (s.expression, r)


@pytest.mark.parametrize("sms", [132, 114])  # H100 / H200 SXM; H100 PCIe
@pytest.mark.parametrize("name", list(PRESETS))
def test_gemv_rings_hold_two_stages(name, sms):
    """The launch DecodeKernels makes for each of the model's GEMVs (its form's CTAs an SM, one
    pair a CTA at most) leaves every CTA at least two stages: the kernel traps below that."""
    cfg = preset(name)
    for kind, (k, n, _, epi) in registry.gemv_shapes(cfg).items():
        form, pairs = registry.gemv_form(k), registry.gemv_pairs(n, epi)
        per_cta = -(-pairs // min(pairs, form.ctas_per_sm * sms))
        assert registry.gemv_stages(k, epi, per_cta) >= 2, (name, kind, k, n)


def test_wide_gemv_form():
    """Only a K past the 7B's down takes the wide form: one CTA an SM with both CTAs'
    consumers and shared memory (the 32B's down: x and two whole-row stages exceed a half)."""
    g = registry.DEFAULT_GEOMETRY
    wide = {(name, kind) for name, cfg in PRESETS.items()
            for kind, (k, *_) in registry.gemv_shapes(cfg).items()
            if registry.gemv_form(k).ctas_per_sm == 1}  # fmt: skip
    assert wide == {("32b", "down")}
    form = registry.gemv_form(27648)
    assert (form.consumers, form.threads, form.smem) == (16, 544, 2 * g.gv_smem)
    narrow = registry.GemvForm(g.gv_consumers, g.gv_ctas_per_sm, g.gv_smem)
    assert registry.gemv_stages(27648, registry.Epilogue.RESIDUAL, 10) == 5
    narrow_only = g.override({"kGvWideMinK": 32768})  # would trap: one stage beside x
    assert registry.gemv_stages(27648, registry.Epilogue.RESIDUAL, 10, narrow_only) == 1
    assert registry.gemv_stages(18944, registry.Epilogue.RESIDUAL, 7) == 3
    assert registry.gemv_form(18944) == narrow
    assert registry.gemv_form(27648, g.override({"kGvCtasPerSm": 1})).consumers == 8


def test_gemv_stage_pairs_balance():
    """stage_pairs' balance rule: at K = 5120 (14B, 32B) one pair a stage gives each pair 8 warps
    for its 5 octets, so 3 idle; 4 pairs give 2 warps 2.5 octets each (the extra rotates). The
    7B's stages stay what the size rule makes them, and the wide form keeps the size rule."""
    E, g = registry.Epilogue, registry.DEFAULT_GEOMETRY
    size_only = g.override({"kGvBalance": 0})
    assert [registry.gemv_stage_pairs(5120, e, size_only) for e in E] == [1, 1, 2]
    assert [registry.gemv_stage_pairs(5120, e) for e in E] == [4, 4, 4]
    assert [registry.gemv_stage_pairs(3584, e) for e in E] == [2, 2, 4]
    assert registry.gemv_stage_pairs(18944, E.RESIDUAL) == 1  # 19 octets: the extras rotate
    assert registry.gemv_stage_pairs(8960, E.RESIDUAL) == 2  # the 1.5B's down: 9 octets
    assert registry.gemv_stage_pairs(27648, E.RESIDUAL) == 1  # wide: 2 stages would be left


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
    assert "  kEos0 = 13," in text and "constexpr int kMaxEos = 8;" in text
    assert "  kSpecSkip = 10," in text and "  kSpecFails = 11," in text
    assert f"constexpr int kBackoffMaxFails = {registry.BACKOFF_MAX_FAILS};" in text
    assert f"constexpr int kBackoffMaxShift = {registry.BACKOFF_MAX_SHIFT};" in text
    assert "  kSwiGLU = 2," in text
    assert registry.STATE_WORDS == registry.StateWord.EOS0 + registry.MAX_EOS


def test_geometry_override():
    g = registry.Geometry().override({"kAttnStages": 8, "kGvEarlyStages": 0})
    assert (g.attn_stages, g.gv_early_stages) == (8, 0)
    assert "constexpr int kAttnStages = 8;" in registry.header(None, g)
    with pytest.raises(ValueError, match="unknown geometry names"):
        registry.Geometry().override({"kAttnStage": 8})


def test_geometry_override_text():
    g = registry.Geometry().override_text("kMrConsumers=8, kMrMaxStages=-4")
    assert (g.mr_consumers, g.mr_max_stages) == (8, -4)
    for bad in ("kMrConsumers", "kMrConsumers=", "kMrConsumers=1.5", "kMrConsumers=2,"):
        with pytest.raises(ValueError, match="expected NAME=integer"):
            registry.Geometry().override_text(bad)
    with pytest.raises(ValueError, match="unknown geometry names"):
        registry.Geometry().override_text("kMrConsumer=1")


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


def assert_rows_specs_fit(specs, cfg) -> None:
    """gemv_rows.cu's kernels `specs` compile with no spills, one CTA an SM within the register
    file, the shared memory within the SM's 227 KB."""
    res = registry.compile_specs(specs, cfg)[registry.GEMV_ROWS].resources()
    for s in specs:
        r = res[s.expression]
        assert r.spill_bytes == 0, s.expression
        assert r.registers * s.threads <= 65536, s.expression
        assert s.smem + r.smem_bytes <= 227 * 1024, s.expression


@pytest.mark.parametrize("name", ["1.5b", "7b", "14b"])
def test_gemv_rows_specs_compile(name):
    """The M-row GEMV (gemv_rows.cu) of the four shapes at both token buckets fits, and so
    does the multi-row steps' embedding beside it."""
    cfg = preset(name)
    specs = registry.rows_specs(cfg)
    gemvs = [s for s in specs if s.name == "gemv_rows"]
    assert {s.targs[1] for s in gemvs} == set(registry.ROW_BUCKETS) and len(gemvs) == 8
    assert [s.name for s in specs if s.name != "gemv_rows"] == ["embed_rows"]
    assert_rows_specs_fit(specs, cfg)


def test_gemv_rows_bad_rows_raise():
    """M = 0 or M > 16 (or not an int) is refused before anything is launched."""
    from nanoqwen.cuda.decode import DecodeKernels
    from nanoqwen.errors import NanoqwenError

    k = DecodeKernels.__new__(DecodeKernels)  # no GPU: the check comes first
    for m in (0, -1, registry.MAX_ROWS + 1, 2.0):
        with pytest.raises(NanoqwenError, match="m must be 1..16"):
            k.gemv_rows("o", m, 0, 0, 0, 0, link=None)
        with pytest.raises(NanoqwenError, match="m must be 1..16"):
            k.embed_rows(0, 0, 0, 0, 0, m, link=None)
    with pytest.raises(ValueError, match="1..16"):
        registry.row_bucket(17)
    assert [registry.row_bucket(m) for m in (1, 8, 9, 16)] == [8, 8, 16, 16]


@pytest.mark.parametrize("name", ["0.5b", "1.5b", "3b", "7b", "14b", "32b"])
@pytest.mark.parametrize("num_sms", [132, 114])
def test_gemv_rows_split_fits(name, num_sms):
    """Every shape and bucket: the K slices (whole K, or slices of at most ROWS_SLICE_GROUPS
    groups: one TMA box row) leave at least two ring stages on the H200/H100 SXM (132 SMs) and
    the H100 PCIe (114), two a team where the consumers work in teams (rows_teams: gate/up
    at MT = 8 on the 1.5B, 3B and 7B; the 0.5B's CTAs run 6 stages, the 14B's and 32B's ring
    holds 3); the grid is one CTA an SM at
    most, each a whole stage's pairs (when there are that many); the slices cover K, none
    empty; the 7B's hidden size needs no slices and its down_proj does."""
    for kind, (k, n, _, epi) in registry.gemv_shapes(preset(name)).items():
        for mt in registry.ROW_BUCKETS:
            s = registry.rows_split(k, n, epi, mt)
            teams = registry.rows_teams(k, n, epi, mt, s)
            two = mt == 8 and kind == "gate_up" and name in ("1.5b", "3b", "7b")
            assert teams == (registry.DEFAULT_GEOMETRY.mr_teams if two else 1), (kind, mt)
            groups = k // 128
            assert s == 1 or -(-groups // s) <= registry.ROWS_SLICE_GROUPS, (kind, mt, s)
            grid = registry.rows_grid(n, epi, num_sms)
            pairs = registry.gemv_pairs(n, epi)
            assert 1 <= grid <= num_sms
            assert pairs // grid >= min(pairs, registry.DEFAULT_GEOMETRY.mr_min_pairs)
            npairs = -(-pairs // grid)
            assert registry.rows_stages(k, mt, s, npairs, teams=teams) >= 2 * teams, (kind, mt)
            widths = [(r + 1) * groups // s - r * groups // s for r in range(s)]
            assert sum(widths) == groups and min(widths) >= 1
            if name == "7b":
                assert (s == 1) == (kind != "down"), (kind, mt, s)


@pytest.mark.parametrize("name", ["1.5b", "7b", "32b"])
def test_gemv_rows_split_specs_compile(name):
    """down_proj's split over K (gemv_rows_split and its sum) at both token buckets fits."""
    cfg = preset(name)
    specs = registry.rows_split_specs(cfg)
    assert [s.key for s in specs] == [f"gemv_rows_split{p}_m{mt}" for mt in registry.ROW_BUCKETS
                                      for p in ("_down", "_sum")]  # fmt: skip
    assert_rows_specs_fit(specs, cfg)


@pytest.mark.parametrize("name", ["0.5b", "1.5b", "3b", "7b", "14b", "32b"])
@pytest.mark.parametrize("num_sms", [132, 114])
@pytest.mark.parametrize("mt", [*registry.ROW_BUCKETS, 32])
def test_gemv_rows_split_grid_covers_the_matrix(name, num_sms, mt):
    """gemv_rows_split's plan, as the kernel splits it: the K slices (at most one TMA box row of
    ROWS_SLICE_GROUPS groups, none empty) cover K, the row ranges (whole stages, none empty)
    cover Npad, one wave of one CTA an SM, mr_split_min_stages ring stages, and the workspace
    holds [S][Npad][MT] (MT = 32: the rule alone, no bucket compiles it)."""
    cfg, g = preset(name), registry.DEFAULT_GEOMETRY
    k, n, _, _ = registry.gemv_shapes(cfg)["down"]
    groups, rows = k // 128, registry.rows_split_stage_rows(g)
    ranges, s = registry.rows_split_grid(k, n, mt, num_sms)
    assert s == registry.rows_split_slices(k, mt) >= 2 and ranges * s <= num_sms
    widths = [(j + 1) * groups // s - j * groups // s for j in range(s)]
    assert sum(widths) == groups and 1 <= min(widths)
    assert max(widths) == -(-groups // s) <= registry.ROWS_SLICE_GROUPS
    assert registry.rows_split_stages(k, mt, s) >= g.mr_split_min_stages
    npad = registry.rows_split_padded(n)
    blocks = npad // rows
    assert npad % rows == 0 and n <= npad < n + rows
    spans = [(b + 1) * blocks // ranges - b * blocks // ranges for b in range(ranges)]
    assert sum(spans) == blocks and min(spans) >= 1
    if mt in registry.ROW_BUCKETS:
        assert registry.rows_split_workspace(cfg) >= s * npad * mt * 4
    if name == "7b" and mt == 16:
        assert (ranges, s) == ((13, 10) if num_sms == 132 else (11, 10))


def test_gemv_rows_split_bad_rows_raise():
    """M = 0 or M > 16 (or not an int) is refused before anything is launched."""
    from nanoqwen.cuda.decode import DecodeKernels
    from nanoqwen.errors import NanoqwenError

    k = DecodeKernels.__new__(DecodeKernels)  # no GPU: the check comes first
    for m in (0, registry.MAX_ROWS + 1, 2.0):
        with pytest.raises(NanoqwenError, match="m must be 1..16"):
            k.gemv_rows_split(m, 0, 0, 0, 0, 0, 0, link=None)
