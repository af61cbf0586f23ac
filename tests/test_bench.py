"""`nanoqwen bench`: the pure parts on the CPU (max-context default, flags, the per-kernel table
from a fake trace, per-position ITL, the plot, the transformers baseline's timing streamer and
its skip path, the baseline itself on the CPU with the tiny shapes); one GPU test runs the
whole command with --kernels on the tiny synthetic model."""

import json
import sys
import time

import numpy as np
import pytest

from nanoqwen.cli import build_parser, main
from nanoqwen.config import preset
from nanoqwen.cuda.device import sm90_available
from nanoqwen.errors import NanoqwenError
from nanoqwen.harness import bench
from nanoqwen.harness.baseline import (
    TokenTimer,
    bench_baseline,
    compare,
    print_baseline,
    run_baseline,
)


# -- max context and flags ----------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, gen, want",
    [(512, 128, 640), (8192, 128, 8320), (32704, 64, 32768), (500, 10, 512), (1, 2, 16)],
)
def test_default_max_context_is_whole_pages(prompt, gen, want):
    assert bench.default_max_context(prompt, gen) == want
    assert bench.default_max_context(prompt, gen, limit=32768) == min(want, 32768)


def test_default_max_context_capped_at_the_model_limit():
    assert bench.default_max_context(32760, 64, limit=32768) == 32768


def test_bench_defaults():
    a = build_parser().parse_args(["bench", "m.nanoqwen"])
    assert a.max_context is None  # -> prompt + gen rounded to a page, at run time
    assert (a.prompt_len, a.gen_len, a.warmup, a.runs) == (512, 128, 3, 10)
    assert not a.kernels and a.plot is None and a.baseline is None and a.json is None
    assert (a.baseline_warmup, a.baseline_runs, a.kernel_reps) == (1, 3, 20)


def test_bench_flags():
    a = build_parser().parse_args(
        ["bench", "m.nanoqwen", "--prompt-len", "32704", "--gen-len", "64", "--kernels",
         "--plot", "itl.png", "--baseline", "transformers", "--baseline-runs", "2",
         "--max-context", "40000"]
    )  # fmt: skip
    assert (a.prompt_len, a.gen_len, a.max_context) == (32704, 64, 40000)
    assert a.kernels and a.plot == "itl.png" and a.baseline == "transformers"
    assert a.baseline_runs == 2


@pytest.mark.parametrize(
    "argv",
    [["--gen-len", "1"], ["--runs", "0"], ["--baseline", "vllm"], ["--prompt-len", "0"]],
)
def test_bench_rejects_bad_flags(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "m.nanoqwen", *argv])


def test_bench_help_lists_the_flags(capsys):
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    for flag in ("--kernels", "--plot", "--baseline", "--baseline-runs", "--max-context"):
        assert flag in out


# -- --kernels: aggregation of a fake trace ---------------------------------------------------
def fake_step():
    """Two layers of a made-up step: (label, seconds, bytes; 0 = unknown)."""
    layer = [
        ("gemv qkv", 10e-6, 30_000_000),
        ("attention split", 4e-6, 1_000_000),  # its K/V over the context
        ("attention combine", 1e-6, 0),
        ("gemv o", 6e-6, 20_000_000),
    ]
    return [("embed", 1e-6, 7168), *layer, *layer, ("lm_head", 25e-6, 40_000_000),
            ("sample", 2e-6, 600_000)]  # fmt: skip


def test_aggregate_kernels_by_label():
    timed = fake_step()
    nbytes = [b for _, _, b in timed]
    step_s = 100e-6
    k = bench.aggregate_kernels(timed, step_s)
    rows = {r["label"]: r for r in k["rows"]}
    assert set(rows) == {"embed", "gemv qkv", "attention split", "attention combine", "gemv o",
                         "lm_head", "sample"}  # fmt: skip
    assert rows["gemv qkv"]["count"] == 2 and rows["embed"]["count"] == 1
    assert rows["gemv qkv"]["us"] == pytest.approx(20.0)
    assert rows["gemv qkv"]["bytes"] == 60_000_000
    assert rows["gemv qkv"]["tb_s"] == pytest.approx(60e6 / 20e-6 / 1e12)
    assert rows["gemv qkv"]["share_pct"] == pytest.approx(20.0)
    assert rows["attention split"]["bytes"] == 2_000_000
    assert rows["attention combine"]["bytes"] is None and rows["attention combine"]["tb_s"] is None
    assert k["unknown_bytes"] == ["attention combine"]
    # Slowest first.
    us = [r["us"] for r in k["rows"]]
    assert us == sorted(us, reverse=True) and k["rows"][0]["label"] == "lm_head"
    total = sum(s for _, s, _ in timed)
    s = k["sum_of_kernels"]
    assert s["count"] == len(timed) == 11
    assert s["us"] == pytest.approx(1e6 * total)
    assert s["share_pct"] == pytest.approx(sum(r["share_pct"] for r in k["rows"]))
    assert s["bytes"] == sum(nbytes)
    w = k["whole_step"]
    assert w["us"] == pytest.approx(100.0) and w["share_pct"] == pytest.approx(100.0)
    assert k["overhead_us"] == pytest.approx(100.0 - 1e6 * total)
    json.dumps(k)  # goes into --json as is


def test_format_kernels_table():
    k = bench.aggregate_kernels(fake_step(), 100e-6)
    k.update(pos=512, context=513, reps=20, timed=5)
    text = bench.format_kernels(k)
    lines = text.splitlines()
    assert "position 512" in lines[0] and "context 513" in lines[0]
    for label in ("gemv qkv", "attention combine", "lm_head", "sum of kernels", "whole step"):
        assert any(line.strip().startswith(label) for line in lines), label
    combine = next(line for line in lines if line.strip().startswith("attention combine"))
    assert " - " in combine  # unknown bytes and TB/s print as "-"
    assert "100.0%" in next(line for line in lines if "whole step" in line)
    assert "overhead" in text


# -- --plot: inter-token latency by position ---------------------------------------------------
def test_itl_by_position_is_the_median_over_runs():
    runs = [[0.001, 0.004, 0.003], [0.003, 0.002, 0.001], [0.002, 0.002, 0.002]]
    assert bench.itl_by_position(runs) == pytest.approx([2.0, 2.0, 2.0])
    assert bench.itl_by_position([np.array([0.001, 0.002])]) == pytest.approx([1.0, 2.0])
    assert bench.itl_by_position([]) == []
    with pytest.raises(ValueError):
        bench.itl_by_position([[0.001], [0.001, 0.002]])


class _Clocked:
    """A Gpu stand-in whose SM clock reads `mhz` (None: no NVML), counting the reads."""

    def __init__(self, mhz):
        self.mhz, self.reads = mhz, 0

    def sm_clock_mhz(self):
        self.reads += 1
        return self.mhz


def test_clock_sampler_means_over_a_window():
    gpu = _Clocked(1980)
    with bench.ClockSampler(gpu, period=0.001) as clocks:
        t0 = time.perf_counter()
        time.sleep(0.05)
        gpu.mhz = 1500
        t1 = time.perf_counter()
        time.sleep(0.05)
        t2 = time.perf_counter()
    reads = gpu.reads
    time.sleep(0.01)
    assert gpu.reads == reads  # the thread stopped with the block
    # A read can straddle the switch (read before it, stamped after): most are not.
    assert 1740 < clocks.mean(t0, t1) <= 1980
    assert 1500 <= clocks.mean(t1, t2) < 1740
    assert 1500 < clocks.mean(t0, t2) < 1980
    after = time.perf_counter() + 10
    assert clocks.mean(after, after + 1) == 1500  # no sample inside: the nearest


def test_clock_sampler_records_nothing_without_nvml():
    gpu = _Clocked(None)
    with bench.ClockSampler(gpu, period=0.001) as clocks:
        time.sleep(0.01)
    assert gpu.reads == 1 and clocks.samples == []
    assert clocks.mean(0.0, time.perf_counter()) is None


def test_print_result_shows_the_clocks(capsys):
    res = {**fake_result(), "k_cache": "fp16x2", "itl_wall_ms": 2.7, "tokens_per_s": 370.0,
           "achieved_tb_s": 1.6, "copy_tb_s": 4.1}  # fmt: skip
    bench.print_result({**res, "sm_mhz": {"ttft": 1492.4, "decode": 1980.0}})
    assert "SM clock: 1492 MHz in the TTFT, 1980 in the decode" in capsys.readouterr().out
    bench.print_result({**res, "sm_mhz": {"ttft": None, "decode": None}})
    assert "SM clock" not in capsys.readouterr().out


def fake_result(n=127):
    rng = np.random.default_rng(0)
    itl = list(2.7 + 0.01 * rng.standard_normal(n))
    return {"gpu": "NVIDIA H200", "model": "7b", "prompt_len": 512, "gen_len": n + 1,
            "runs": 10, "itl_ms": float(np.median(itl)), "ttft_ms": 30.0,
            "itl_by_position_ms": itl}  # fmt: skip


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "itl.png"
    bench.plot_itl(fake_result(), str(path))
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_plot_without_matplotlib_fails_before_the_benchmark(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError
    with pytest.raises(NanoqwenError, match="matplotlib"):
        bench.require_matplotlib()
    # The CLI refuses before opening the (missing) model file: a clear error, exit 2.
    rc = main(["bench", str(tmp_path / "missing.nanoqwen"), "--plot", str(tmp_path / "a.png")])
    assert rc == 2
    assert "matplotlib" in capsys.readouterr().err


# -- --baseline transformers ------------------------------------------------------------------
def test_token_timer_stamps_generated_tokens_only():
    clock = iter([0.5, 1.0, 1.25, 1.75, 2.0])
    t = TokenTimer(clock=lambda: next(clock))
    t.put(np.arange(16)[None, :])  # the prompt
    for tok in (7, 8, 9):
        t.put(np.array([tok]))
    t.end()
    assert t.prompt_at == 0.5 and t.stamps == [1.0, 1.25, 1.75] and t.ended_at == 2.0
    assert t.ttft(0.0) == pytest.approx(1.0)
    assert list(t.gaps()) == pytest.approx([0.25, 0.5])
    with pytest.raises(RuntimeError):
        TokenTimer().ttft(0.0)


def test_token_timer_is_a_transformers_streamer():
    pytest.importorskip("transformers")
    from transformers.generation.streamers import BaseStreamer

    from nanoqwen.harness.baseline import _streamer_class

    assert issubclass(_streamer_class(), BaseStreamer)


def test_baseline_skips_without_transformers(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    b = bench_baseline(preset("tiny"), {"prompt_len": 8, "gen_len": 4})
    assert set(b) == {"name", "skipped"} and "not importable" in b["skipped"]
    json.dumps(b)


def test_baseline_skips_without_cuda(capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    b = bench_baseline(preset("tiny"), {"prompt_len": 8, "gen_len": 4})
    assert "no CUDA device" in b["skipped"]
    print_baseline(b)
    assert "skipped" in capsys.readouterr().out


def test_compare_is_theirs_over_ours():
    got = compare({"itl_ms": 2.0, "ttft_ms": 30.0}, {"itl_ms": 10.0, "ttft_ms": 45.0})
    assert got == {"speedup_itl": 5.0, "speedup_ttft": 1.5}


def test_baseline_runs_on_the_cpu_with_tiny_shapes(capsys):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from nanoqwen.harness.baseline import build_model

    cfg = preset("tiny")
    m = build_model(cfg, device="cpu", dtype="bfloat16")
    p = next(m.parameters())
    assert p.dtype == torch.bfloat16 and p.device.type == "cpu"
    assert m.config.vocab_size == cfg.vocab_size and m.config.num_hidden_layers == cfg.num_layers
    del m
    b = run_baseline(cfg, prompt_len=8, gen_len=5, warmup=1, runs=2, device="cpu",
                     dtype="float32")  # fmt: skip
    assert (b["prompt_len"], b["gen_len"], b["runs"]) == (8, 5, 2)
    assert 0 < b["itl_ms"] < b["ttft_ms"] + 1e3 and b["tokens_per_s"] > 0
    b = bench_baseline(cfg, {"prompt_len": 8, "gen_len": 3, "itl_ms": 1.0, "ttft_ms": 1.0},
                       warmup=0, runs=1, device="cpu", dtype="float32")  # fmt: skip
    assert b["speedup_itl"] == pytest.approx(b["itl_ms"])
    print_baseline(b)
    assert "faster" in capsys.readouterr().out


# -- on the GPU: the whole command on the tiny synthetic model ----------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not sm90_available(), reason="needs an sm_90 GPU")
def test_bench_kernels_on_tiny(tiny_model, tmp_path, capsys):
    out = tmp_path / "b.json"
    rc = main(["bench", str(tiny_model), "--prompt-len", "40", "--gen-len", "9", "--warmup", "1",
               "--runs", "2", "--kernels", "--kernel-reps", "5", "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "sum of kernels" in text and "whole step (graph)" in text
    res = json.loads(out.read_text())
    assert res["max_context"] == 64  # 40 + 9 -> 4 pages
    assert len(res["itl_by_position_ms"]) == 8
    mhz = res["sm_mhz"]  # each None where NVML cannot tell
    assert set(mhz) == {"ttft", "decode"} and all(v is None or 100 < v < 5000 for v in mhz.values())
    k = res["kernels"]
    assert k["pos"] == 40 and k["context"] == 41
    assert k["timed"] == 5 and "(median of 5 launches)" in text
    assert len(k["launches"]) == k["sum_of_kernels"]["count"]
    assert k["rows"] and all(r["us"] > 0 and r["count"] >= 1 for r in k["rows"])
    assert sum(r["count"] for r in k["rows"]) == k["sum_of_kernels"]["count"]
    assert k["whole_step"]["us"] > 0
    assert any("attention" in r["label"] and r["bytes"] for r in k["rows"])


def test_run_part_keeps_going_after_a_failure():
    from nanoqwen.harness.gpu_script import run_part

    logs, results = [], {}
    assert run_part("first", results, logs.append, lambda: 3) == 3
    assert run_part("second", results, logs.append, lambda: 1 / 0) is None
    assert run_part("third", results, logs.append, lambda: False) is False
    assert results == {"first": 3, "second": None, "third": False}
    assert any("second: FAILED" in m and "ZeroDivisionError" in m for m in logs)
    assert sum(m.startswith("[") and m.endswith(" s]") for m in logs) == 3


def test_step_op_names_one_operation_across_the_steps():
    for label in ("gemv down", "gemv_rows down", "gemm down"):
        assert bench.step_op(label) == "down"
    assert bench.step_op("gemv_rows gate_up") == "gate_up"
    assert bench.step_op("attention_rows") == bench.step_op("attention") == "attention"
    assert bench.step_op("lm_head_rows") == bench.step_op("lm_head") == "lm_head"
    assert bench.step_op("prefill attention merge") == "prefill attention merge"


def test_compare_steps_side_by_side():
    decode = bench.aggregate_kernels(fake_step(), 100e-6)
    rows = [("embed", 2e-6, 0), ("gemv_rows qkv", 15e-6, 0), ("attention_rows", 6e-6, 0),
            ("gemm o", 9e-6, 0), ("lm_head_rows", 50e-6, 0)] * 2  # fmt: skip
    verify = bench.aggregate_kernels(rows, 200e-6)
    lines = bench.compare_steps({"decode": decode, "M=8": verify}).splitlines()
    assert "decode" in lines[0] and "M=8" in lines[0]
    cells = {line[2:22].strip(): line[22:].split() for line in lines[1:] if line[2:3] != "-"}
    # qkv: 2 x 10 us against 2 x 15 us; lm_head 25 against 100 (two launches of 50)
    assert cells["qkv"] == ["20.0", "1.00x", "30.0", "1.50x"]
    assert cells["lm_head"] == ["25.0", "1.00x", "100.0", "4.00x"]
    assert cells["sample"] == ["2.0", "1.00x", "-"]  # the verify step has no sampler
    assert cells["attention"] == ["-", "12.0"]  # attention_rows; no decode label of the op
    assert cells["attention split"] == ["8.0", "1.00x", "-"]
    whole = next(line for line in lines if "whole step" in line)
    assert "200.0" in whole and "2.00x" in whole
    assert any(line.strip() == "o: gemv o | gemm o" for line in lines)


def test_commit_id(monkeypatch):
    """A record names $NANOQWEN_COMMIT when set (a GPU host's copy of the tree has a stale git),
    else git's description of the checkout."""
    from nanoqwen.harness.bench import commit_id

    monkeypatch.setenv("NANOQWEN_COMMIT", "abc1234")
    assert commit_id() == "abc1234"
    monkeypatch.delenv("NANOQWEN_COMMIT")
    assert commit_id() not in ("", "abc1234")


@pytest.mark.parametrize("text", ["0,1", "1,,2", "a", ""])
def test_bench_concurrency_rejects_bad_levels(text):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "m.nanoqwen", "--concurrency", text])


@pytest.mark.usefixtures("one_torch_thread")
def test_bench_concurrency_on_the_reference(tiny_model, tmp_path, capsys):
    out, png = tmp_path / "c.json", tmp_path / "c.png"
    plot = ["--plot", str(png)] if _has_matplotlib() else []
    rc = main(["bench", str(tiny_model), "--backend", "reference", "--concurrency", "1,3",
               "--prompt-len", "20", "--gen-len", "5", "--prefill-chunk", "16", "--warmup", "0",
               "--json", str(out), *plot])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["command"].startswith("nanoqwen bench ") and "--concurrency 1,3" in res["command"]
    assert [r["concurrency"] for r in res["levels"]] == [1, 3]
    for r in res["levels"]:
        assert r["tokens_per_s"] > 0 and 0 < r["ttft_p50_ms"] <= r["ttft_p99_ms"]
        assert 0 < r["itl_p50_ms"] and r["preemptions"] == 0
    # One stream runs solo (generate(): its prompt at once, a token a step); three share the
    # 16-token chunk budget over their 20-token prompts: 4 steps before the last first token.
    assert res["levels"][0]["steps"] == 5 and res["levels"][1]["steps"] >= 4 + 4
    assert res["max_context"] == 3 * 32  # room for every stream of the largest N
    assert "tok/s" in capsys.readouterr().out
    assert not plot or png.stat().st_size > 0


def _has_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


# -- --workload verify --------------------------------------------------------------------------
def test_bench_verify_rows_flag():
    a = build_parser().parse_args(["bench", "m.nanoqwen", "--workload", "verify", "--rows", "1,8"])
    assert a.workload == "verify" and a.rows == [1, 8]
    assert build_parser().parse_args(["bench", "m.nanoqwen"]).rows is None  # -> 1,2,4,8,16


@pytest.mark.parametrize("text", ["0,1", "1,17", "1,,2", "a", ""])
def test_bench_verify_rejects_bad_rows(text):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "m.nanoqwen", "--workload", "verify", "--rows", text])


@pytest.mark.parametrize("other", [["--workload", "edit"], ["--concurrency", "1,2"], []])
def test_bench_rows_belong_to_the_verify_workload(other, capsys):
    assert main(["bench", "m.nanoqwen", "--rows", "1,8", *other]) != 0
    assert "--rows belongs to the verify workload" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, need",
    [(["--workload", "verify", "--prompt-len", "90"], "90 + 16"),
     (["--workload", "prefix", "--prompt-len", "60", "--new-len", "30", "--gen-len", "20"],
      "90 + 20")],
)  # fmt: skip
def test_bench_refuses_a_cache_too_short(tiny_model, capsys, argv, need):
    assert main(["bench", str(tiny_model), "--max-context", "100", *argv]) != 0  # no engine built
    assert f"shorter than the {need} this workload needs" in capsys.readouterr().err


@pytest.mark.parametrize("workload", ["prefix", "verify", "edit"])
def test_bench_e2e_flags_belong_to_e2e(workload, capsys):
    assert main(["bench", "m.nanoqwen", "--workload", workload, "--kernels"]) != 0
    assert "belong to the e2e workload" in capsys.readouterr().err


def test_verify_rows_table_ratios():
    from nanoqwen.harness.verify_bench import rows_table

    t = rows_table(1000.0, {8: 1200.0, 1: 1100.0, 16: 1600.0})
    assert [r["m"] for r in t] == [1, 8, 16]
    assert [round(r["x_decode"], 3) for r in t] == [1.1, 1.2, 1.6]
    assert [round(r["x_m1"], 4) for r in t] == [1.0, round(1200 / 1100, 4), round(1600 / 1100, 4)]
    assert [r["ms_per_token_all_accepted"] for r in t] == [1.1, 0.15, 0.1]
    assert rows_table(1000.0, {8: 1200.0})[0]["x_m1"] is None  # no M = 1 row to divide by


def test_print_verify_result(capsys):
    from nanoqwen.harness.verify_bench import print_verify_result, rows_table

    print_verify_result({"model": "7b", "context": 512, "down_proj": "split", "gpu": "H200",
                         "reps": 20, "decode_step_us": 1448.5,
                         "rows": rows_table(1448.5, {1: 1675.5, 8: 1716.8})})  # fmt: skip
    words = " ".join(capsys.readouterr().out.split())  # the figures, whatever the spacing
    assert "down_proj split (H200; us a step, graphs of 20) decode step 1448.5 us" in words
    assert "accepted 1 1675.5 1.000 1.157 1.675 8 1716.8 1.025 1.185 0.215" in words


@pytest.mark.gpu
@pytest.mark.skipif(not sm90_available(), reason="needs an sm_90 GPU")
def test_bench_verify_on_tiny(tiny_model, tmp_path, capsys):
    out = tmp_path / "v.json"
    rc = main(["bench", str(tiny_model), "--workload", "verify", "--rows", "1,4,16",
               "--prompt-len", "40", "--kernel-reps", "5", "--json", str(out)])  # fmt: skip
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["workload"] == "verify" and res["context"] == 40 and res["reps"] == 5
    assert res["decode_step_us"] > 0 and [r["m"] for r in res["rows"]] == [1, 4, 16]
    assert all(r["us"] > 0 and r["x_decode"] > 0 for r in res["rows"])
    assert res["rows"][0]["x_m1"] == 1.0
    assert "x decode" in capsys.readouterr().out
