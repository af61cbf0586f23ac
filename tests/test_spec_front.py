"""Speculative decoding from the outside: the --speculate/--spec-k/--spec-ngram flags of every
command and LLM(speculative=...) reaching the backend, the SpecStats in generate's stats line,
the server's usage and /metrics, the stdlib workload builder, and `bench --workload edit|fim|
chat` on the reference backend with the tiny synthetic model."""

from __future__ import annotations

import ast
import asyncio
import contextlib
import dataclasses
import itertools
import json
import sysconfig
from pathlib import Path

import pytest

from nanoqwen.cli import build_parser, main
from nanoqwen.commands.generate import speculative_config
from nanoqwen.harness import workloads
from nanoqwen.harness.spec_bench import first_difference, run_spec_bench
from nanoqwen.llm import LLM
from nanoqwen.sampling import SamplingParams
from nanoqwen.speculative import (
    DEFAULT_SPECULATE,
    MAX_BACKOFF,
    MAX_DRAFT_TOKENS,
    SpecStats,
    SpeculativeConfig,
    SpeculativeError,
    resolve,
)

STDLIB = Path(sysconfig.get_paths()["stdlib"])
# A prompt the tiny model's greedy reply copies from: n-gram drafts get accepted.
REPEATING = "def add(a, b):\n    return a + b\n" * 6


@pytest.fixture(autouse=True)
def torch_threads():
    """open_llm sets torch's threads for the whole process: give the other tests theirs back."""
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


# -- flags -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "m.nanoqwen", "-p", "x"],
        ["chat", "m.nanoqwen"],
        ["serve", "m.nanoqwen"],
        ["demo"],
    ],
)
def test_flags_parse_on_every_command(argv):
    parser = build_parser()
    default = parser.parse_args(argv)
    assert default.speculate == DEFAULT_SPECULATE == "off"
    assert speculative_config(default) is None
    args = parser.parse_args(
        [*argv, "--speculate", "ngram", "--spec-k", "6", "--spec-ngram", "2:4", "--spec-backoff",
         "0"]
    )  # fmt: skip
    assert speculative_config(args) == SpeculativeConfig("ngram", 6, 2, 4, backoff_cap=0)


def test_bench_takes_k_and_ngram():
    args = build_parser().parse_args(["bench", "m.nanoqwen", "--workload", "fim", "--spec-k", "3"])
    base = SpeculativeConfig()
    assert speculative_config(args, method="ngram") == SpeculativeConfig(
        "ngram", 3, base.n_min, base.n_max
    )
    args = build_parser().parse_args(["bench", "m", "--workload", "chat", "--spec-backoff", "64"])
    assert speculative_config(args, method="ngram").backoff_cap == 64


@pytest.mark.parametrize("cap", ["-1", str(MAX_BACKOFF + 1), "x"])
def test_spec_backoff_out_of_range_is_refused_while_parsing(cap, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "m", "-p", "x", "--spec-backoff", cap])
    assert exc.value.code == 2 and "--spec-backoff" in capsys.readouterr().err


@pytest.mark.parametrize("k", ["0", str(MAX_DRAFT_TOKENS + 1), "x"])
def test_spec_k_out_of_range_is_refused_while_parsing(k, capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["generate", "m", "-p", "x", "--spec-k", k])
    assert exc.value.code == 2 and "--spec-k" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("ngram", "match"), [("3:1", "n_max"), ("0:2", "n_min"), ("a:b", "MIN:MAX"), ("2-3", "MIN")]
)
def test_bad_ngram_is_refused(ngram, match):
    args = build_parser().parse_args(["generate", "m", "-p", "x", "--speculate", "ngram",
                                      "--spec-ngram", ngram])  # fmt: skip
    with pytest.raises(SpeculativeError, match=match):
        speculative_config(args)


def test_resolve():
    assert resolve(None) is None and resolve("off") is None
    assert resolve("ngram") == SpeculativeConfig()
    assert resolve("ngram", 5, "2") == SpeculativeConfig("ngram", 5, 2, 2)
    assert resolve("ngram", backoff_cap=0) == SpeculativeConfig(backoff_cap=0)
    for bad in (-1, MAX_BACKOFF + 1):
        with pytest.raises(SpeculativeError, match="backoff_cap"):
            resolve("ngram", backoff_cap=bad)
    config = SpeculativeConfig(k=2)
    assert resolve(config) is config
    with pytest.raises(SpeculativeError, match="off, ngram"):
        resolve("eagle")


def test_llm_passes_the_config_to_the_backend(tiny_model):
    with LLM(tiny_model, backend="reference", max_context=256) as llm:
        assert llm.speculative is None and llm.backend.speculative is None
    config = SpeculativeConfig(k=3, n_min=2, n_max=2)
    with LLM(tiny_model, backend="reference", max_context=256, speculative=config) as llm:
        assert llm.backend.speculative is config
    with LLM(tiny_model, backend="reference", max_context=256, speculative="ngram") as llm:
        assert llm.backend.speculative == SpeculativeConfig()


def test_cuda_backend_gets_the_argument_only_with_speculation(tiny_model, monkeypatch):
    """The cuda backend is opened with speculative= when speculation is on, and without it
    otherwise (any engine takes that call); k_cache= only when one is asked for."""
    import nanoqwen.engine as engine
    import nanoqwen.llm as llm_module

    calls = []

    class FakeCuda:
        def __init__(self, file, **kwargs):
            calls.append(kwargs)

    monkeypatch.setattr(llm_module, "_cuda_available", lambda: (True, "faked"))
    monkeypatch.setattr(engine, "CudaBackend", FakeCuda, raising=False)
    LLM(tiny_model, backend="cuda", max_context=256)
    LLM(tiny_model, backend="cuda", max_context=256, speculative="ngram")
    LLM(tiny_model, backend="cuda", max_context=256, k_cache="fp16")
    assert calls == [
        {"max_context": 256},
        {"max_context": 256, "speculative": SpeculativeConfig()},
        {"max_context": 256, "k_cache": "fp16"},
    ]


# -- statistics --------------------------------------------------------------------------------


def test_last_delta_carries_the_stats_and_totals_add_up(tiny_model):
    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as llm:
        ids = llm.prepare(prompt=REPEATING)
        deltas = list(llm.stream(ids, SamplingParams(max_tokens=24)))
        assert all(d.speculative is None for d in deltas[:-1])
        stats = deltas[-1].speculative
        assert stats == llm.backend.spec_stats and stats is not llm.backend.spec_stats
        assert stats.steps > 0 and stats.drafted >= stats.accepted > 0
        assert stats.steps + stats.accepted == 23  # every token after the prefill's first
        stream = llm.stream(ids, SamplingParams(max_tokens=24))
        next(stream), next(stream)
        stream.close()  # cancelled: its steps so far count too
        partial = llm.backend.spec_stats
        assert 0 < partial.steps < stats.steps
        totals = llm.spec_totals
        assert (totals.steps, totals.drafted, totals.accepted) == (
            stats.steps + partial.steps, stats.drafted + partial.drafted,
            stats.accepted + partial.accepted)  # fmt: skip
    with LLM(tiny_model, backend="reference", max_context=512) as llm:
        deltas = list(llm.stream(llm.prepare(prompt="x"), SamplingParams(max_tokens=4)))
        assert all(d.speculative is None for d in deltas) and llm.spec_totals == SpecStats()


def test_stats_summary():
    stats = SpecStats(steps=10, drafted=30, accepted=15, skipped=4)
    assert stats.tokens_per_step == 2.5 and stats.acceptance == 0.5
    assert stats.summary() == (
        "speculative: 30 drafted, 15 accepted (50%), 2.50 tokens a step, 4 skipped"
    )
    stats.add(SpecStats(1, 2, 3, 5))
    assert stats == SpecStats(11, 32, 18, 9)
    assert SpecStats().tokens_per_step == 1.0 and SpecStats().acceptance == 0.0


def test_generate_prints_the_stats_line(tiny_model, capsys):
    argv = ["generate", str(tiny_model), "-p", REPEATING, "--max-tokens", "12", "--backend",
            "reference", "--speculate", "ngram", "--spec-k", "5"]  # fmt: skip
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "speculative ngram k=5" in err
    line = next(x for x in err.splitlines() if "generated 12 tokens" in x)
    assert "; speculative: " in line and "tokens a step" in line
    assert main(argv[:-4]) == 0
    assert "speculative" not in capsys.readouterr().err


@contextlib.asynccontextmanager
async def served(llm: LLM, **worker):
    """An httpx client of the app over `llm`, its Worker(llm, **worker) running meanwhile."""
    import httpx

    from nanoqwen.server import Worker, create_app

    engine = Worker(llm, **worker)
    engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(llm, engine))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            yield client
    finally:
        engine.stop()


def test_usage_and_metrics_report_speculation(tiny_model):
    """A one-stream server (--max-batch 1) keeps speculative decoding."""

    async def run() -> tuple[dict, dict, str]:
        async with served(llm, max_queue=2, max_batch=1) as client:
            body = {"model": llm.model_name, "prompt": REPEATING, "max_tokens": 16}
            plain = (await client.post("/v1/completions", json=body)).json()
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            r = await client.post("/v1/completions", json=body)
            chunks = [json.loads(e[6:]) for e in r.text.split("\n\n") if e[6:7] == "{"]
            metrics = (await client.get("/metrics")).text
        return plain["usage"], chunks[-1]["usage"], metrics, llm.spec_totals

    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as llm:
        usage, streamed, metrics, totals = asyncio.run(run())
    assert usage["completion_tokens"] == streamed["completion_tokens"] == 16
    # The two requests need not take the same steps: the second one prefills only past its
    # cached prefix, and the tiny random model's logits have near-ties that rounding can flip.
    for spec in (usage["speculative"], streamed["speculative"]):
        assert spec["steps"] + spec["accepted_tokens"] == 15
        assert spec["drafted_tokens"] >= spec["accepted_tokens"] > 0
    both = {k: usage["speculative"][k] + streamed["speculative"][k] for k in usage["speculative"]}
    values = {line.split()[0]: float(line.split()[1]) for line in metrics.splitlines()
              if line.startswith("nanoqwen_spec_")}  # fmt: skip
    assert values == {
        "nanoqwen_spec_drafted_tokens_total": both["drafted_tokens"],
        "nanoqwen_spec_accepted_tokens_total": both["accepted_tokens"],
        "nanoqwen_spec_steps_total": both["steps"],
    }
    assert (totals.steps, totals.drafted, totals.accepted) == (
        both["steps"], both["drafted_tokens"], both["accepted_tokens"])  # fmt: skip
    spec = usage["speculative"]
    openai = pytest.importorskip("openai")  # its clients keep the field as an extra
    parsed = openai.types.CompletionUsage.model_validate(usage)
    assert parsed.completion_tokens == 16 and parsed.model_extra["speculative"] == spec


def test_a_batched_server_drafts_while_a_request_is_alone(tiny_model):
    """With --max-batch above 1 a lone request decodes solo, drafts included, its text that of
    generate() alone; requests side by side hand off into the batch (one token a step). Each
    reply's speculative usage is what its solo stretches drafted, and the LLM's totals are
    their sum."""

    async def run() -> tuple[dict, list[dict]]:
        async with served(llm, max_queue=4, max_batch=2) as client:
            # Greedy: the API's default temperature is 1 (OpenAI's), whose samples on this
            # peaked model match greedy's text only most of the time.
            body = {
                "model": llm.model_name,
                "prompt": REPEATING,
                "max_tokens": 16,
                "temperature": 0,
            }
            lone = (await client.post("/v1/completions", json=body)).json()
            pair = await asyncio.gather(
                *(client.post("/v1/completions", json=body) for _ in range(2))
            )
            return lone, [r.json() for r in pair]

    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as llm:
        lone, pair = asyncio.run(run())
        totals = dataclasses.replace(llm.spec_totals)
    # The same computation as the lone request's: a cold prefill (an empty prefix cache).
    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as fresh:
        alone = fresh.generate(fresh.prepare(REPEATING), SamplingParams(max_tokens=16))
    spec = lone["usage"]["speculative"]
    assert spec["accepted_tokens"] > 0 and spec["steps"] + spec["accepted_tokens"] == 15
    assert lone["choices"][0]["text"] == alone.text  # solo: generate(), as alone
    # The pair's texts are not compared: where a request ran batched depends on timing, and
    # this repetitive model has near-ties that the batched arithmetic can flip (greedy
    # identity across handoffs is tests/test_batching.py's, on a model without near-ties).
    for reply in (lone, *pair):
        assert reply["usage"]["completion_tokens"] == 16
    drafted = [r["usage"].get("speculative", {}).get("drafted_tokens", 0) for r in (lone, *pair)]
    assert totals.drafted == sum(drafted)


def test_usage_has_no_speculative_field_without_speculation():
    from nanoqwen.llm import Delta
    from nanoqwen.server.protocol import Reply

    reply = Reply(chat=False, model="m", prompt_tokens=[3])
    reply.add(0, Delta("x", (1,), "length"))
    assert "speculative" not in reply.usage


# -- the workloads -----------------------------------------------------------------------------


@pytest.mark.parametrize("workload", workloads.WORKLOADS)
def test_workload_prompts_are_deterministic(workload):
    first = workloads.build(workload, 4, seed=1)
    assert first == workloads.build(workload, 4, seed=1)
    assert first != workloads.build(workload, 4, seed=2)
    assert all(p.workload == workload for p in first)


def test_edit_prompts_hold_a_real_stdlib_function():
    for p in workloads.build("edit", 6, seed=0):
        source = (STDLIB / p.source).read_text(encoding="utf-8")
        (function,) = ast.parse(p.function).body  # the whole function, valid on its own
        assert isinstance(function, ast.FunctionDef)
        assert f"def {function.name}(" in source
        first_line = p.function.splitlines()[0].strip()
        assert first_line in source
        (message,) = p.prepare_args()["messages"]
        assert p.function in message["content"] and "whole function" in message["content"]
        lo, hi = workloads.FUNCTION_LINES
        assert lo <= len(p.function.splitlines()) <= hi


def test_fim_prompts_cut_a_real_file():
    for p in workloads.build("fim", 6, seed=0):
        prefix, suffix = p.prepare_args()["fim"]
        source = (STDLIB / p.source).read_text(encoding="utf-8")
        assert prefix + p.function + suffix in source  # contiguous: the gap is the span
        assert p.function.strip() and len(prefix) <= workloads.FIM_PREFIX_CHARS
        assert len(suffix) <= workloads.FIM_SUFFIX_CHARS


def test_chat_prompts_are_questions():
    for p in workloads.build("chat", 8, seed=0):
        (message,) = p.prepare_args()["messages"]
        assert message["content"].endswith("?") or message["content"].endswith(".")
        assert "{" not in message["content"]


def test_unknown_workload_is_refused():
    with pytest.raises(ValueError, match="edit, fim, chat"):
        workloads.build("e2e", 1)


# -- the benchmark -----------------------------------------------------------------------------


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_spec_bench_on_the_reference(tiny_model):
    spec = SpeculativeConfig(k=4)
    opened = []

    def open_llm(config):
        opened.append(config)
        return LLM(tiny_model, backend="reference", max_context=2048, speculative=config)

    prompts = workloads.build("edit", 2, seed=0)
    res = run_spec_bench(open_llm, "edit", prompts, spec, gen_len=12, warmup=0, runs=1)
    assert opened == [None, spec]
    assert res["identical"] and res["first_difference"] is None
    assert res["backend"] == "reference" and res["prompts"] == 2
    a = res["acceptance"]
    assert a["steps"] + a["accepted"] == sum(p["tokens"] - 1 for p in res["per_prompt"])
    assert a["tokens_per_step"] == pytest.approx(1 + a["accepted_per_step"])
    assert res["speedup"] == pytest.approx(
        res["plain_ms_per_token"] / res["speculative_ms_per_token"]
    )
    assert res["speculative_tokens_per_s"] == pytest.approx(1e3 / res["speculative_ms_per_token"])


def test_spec_bench_sampled_on_the_reference(tiny_model):
    """Sampled modes: the parameters reach both modes (seeded per prompt, so a rerun draws
    the same), the identity is not compared, the acceptance still adds up."""
    spec = SpeculativeConfig(k=4)

    def open_llm(config):
        return LLM(tiny_model, backend="reference", max_context=2048, speculative=config)

    prompts = workloads.build("edit", 2, seed=0)
    sampling = SamplingParams(temperature=0.8, top_k=40, top_p=0.95)
    runs = [run_spec_bench(open_llm, "edit", prompts, spec, gen_len=12, warmup=0, runs=1,
                           sampling=sampling) for _ in range(2)]  # fmt: skip
    res = runs[0]
    assert res["sampling"] == {"temperature": 0.8, "top_k": 40, "top_p": 0.95}
    assert res["identical"] is None and res["first_difference"] is None
    assert all(p["identical"] is None for p in res["per_prompt"])
    a = res["acceptance"]
    assert a["steps"] + a["accepted"] == sum(p["speculative_tokens"] - 1 for p in res["per_prompt"])
    assert [p["tokens"] for p in res["per_prompt"]] == [p["tokens"] for p in runs[1]["per_prompt"]]


def test_spec_bench_measures_the_margin_where_replies_part(tiny_model):
    """A greedy mismatch (the speculative reply's 4th token changed): the first differing
    index, and margin() called with the plain reply's context up to it and the two tokens."""

    class Parting:  # the backend, its replies' token 3 replaced
        def __init__(self, backend):
            self.backend = backend

        def __getattr__(self, name):
            return getattr(self.backend, name)

        def generate(self, ids, params, stop):
            for i, t in enumerate(self.backend.generate(ids, params, stop)):
                yield (t + 1) % 64 if i == 3 else t

    def open_llm(config):
        llm = LLM(tiny_model, backend="reference", max_context=2048, speculative=config)
        if config is not None:
            llm._backend = Parting(llm._backend)
        return llm

    calls = []

    def margin(ids, a, b):
        calls.append((ids, a, b))
        return 0.25

    prompts = workloads.build("edit", 1, seed=0)
    res = run_spec_bench(open_llm, "edit", prompts, SpeculativeConfig(k=4), gen_len=8,
                         warmup=0, runs=1, margin=margin)  # fmt: skip
    assert res["identical"] is False
    assert res["first_difference"] == {"prompt": 0, "index": 3, "margin": 0.25}
    assert res["per_prompt"][0]["split_margin"] == 0.25
    ((ids, a, b),) = calls
    assert b == (a + 1) % 64 and len(ids) == res["per_prompt"][0]["prompt_tokens"] + 3


def test_bench_command_writes_json(tiny_model, tmp_path, capsys):
    out = tmp_path / "chat.json"
    rc = main(["bench", str(tiny_model), "--workload", "chat", "--backend", "reference",
               "--requests", "1", "--gen-len", "6", "--warmup", "0", "--runs", "1",
               "--max-context", "2048", "--spec-k", "3", "--json", str(out)])  # fmt: skip
    assert rc == 0
    text = capsys.readouterr().out
    assert "speed-up" in text and "outputs identical: yes" in text
    res = json.loads(out.read_text())
    assert res["workload"] == "chat" and res["speculative"]["k"] == 3
    assert {"speedup", "acceptance", "identical", "plain_tokens_per_s"} <= res.keys()


# -- dev/draft_model.py's projection -----------------------------------------------------------


@pytest.fixture(scope="module")
def draft_model():
    import importlib.util

    path = Path(__file__).parent.parent / "dev" / "draft_model.py"
    spec = importlib.util.spec_from_file_location("draft_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_verify_cost_ratio_interpolates_and_extends(draft_model):
    r = draft_model.cost_ratio("1:2.0,2:2.2,4:2.4")
    assert r(1) == 1.0 and r(2) == pytest.approx(1.1) and r(3) == pytest.approx(1.15)
    assert r(6) == pytest.approx(1.3)  # the last segment's slope, 0.1 ms a row
    with pytest.raises(ValueError, match="M = 1"):
        draft_model.cost_ratio("2:2.0,4:2.4")


def test_walk_and_projection(draft_model):
    """A 12-token generation: the draft model agrees 3, then 5 tokens; n-gram drafts nothing."""
    accepted = [[0, 3, 2, 1, 0, 5, 4, 3, 2, 1, 0, 0]]
    steps = draft_model.draft_steps([[1] * 5], accepted, gen_len=12, k=8)
    assert steps[0][1] == (8, 3) and steps[0][10] == (1, 0)  # capped by step_limit
    taken = [draft_model.walk(s) for s in steps]
    assert taken == [[(8, 3), (6, 5), (0, 0)]]  # positions 1, 5, 11

    def flat(rows: int) -> float:  # a verify step as cheap as a decode step
        return 1.0

    plain = draft_model.project([[(0, 0)] * 11], 2.0, None, flat)
    assert plain["ms_per_token"] == 2.0 and plain["speedup"] == 1.0
    # target: 3 steps of 2 ms; draft: (1 + 7) + (1 + 5) steps of 1 ms after its drafting steps
    got = draft_model.project(taken, 2.0, 1.0, flat)
    assert got["ms_per_token"] == pytest.approx((3 * 2.0 + 8 + 6) / 11)
    assert got["steps"] == 3 and got["accepted_per_step"] == pytest.approx(8 / 3)


# -- dev/spec_backoff_walk.py's projection ---------------------------------------------------


@pytest.fixture(scope="module")
def backoff_walk():
    import importlib.util
    import sys

    dev = Path(__file__).parent.parent / "dev"
    sys.path.insert(0, str(dev))  # it imports draft_model's cost_ratio from beside it
    try:
        spec = importlib.util.spec_from_file_location("spec_backoff_walk",
                                                      dev / "spec_backoff_walk.py")  # fmt: skip
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(dev))
    return module


def test_walk_verify_costs_by_k(backoff_walk):
    assert backoff_walk.verify_costs("1.5", [3, 15]) == {3: 1.5, 15: 1.5}
    # step times by rows, M = 1 the decode step: K drafts run 1 + K rows
    got = backoff_walk.verify_costs("1:1000,8:1300,16:1700", [7, 15, 3])
    assert got == {7: 1.3, 15: 1.7, 3: pytest.approx(1 + 0.3 * 3 / 7, abs=1e-4)}
    with pytest.raises(ValueError, match="M = 1"):
        backoff_walk.verify_costs("8:1300,16:1700", [7])


@pytest.mark.parametrize("k", [2, 4, 15])
def test_walk_emits_the_truth_step_by_step(backoff_walk, k):
    """Every step emits its accepted drafts plus the model's token: steps + accepted = the
    truth's decode tokens, whatever K; at a verify cost of 1 the cost counts the steps."""
    pattern = [11, 12, 13, 14, 15, 16]
    prompt, truth = pattern * 3, pattern * 4 + [99, 98]
    spec = dataclasses.replace(SpeculativeConfig(), k=k)
    cost, (verify, accepted, _) = backoff_walk.walk(prompt, truth, spec, len(truth), 1.0)
    assert cost + accepted == len(truth) - 1 and accepted > 0 and verify > 0
    dearer, counts = backoff_walk.walk(prompt, truth, spec, len(truth), 2.0)
    assert counts[:2] == [verify, accepted] and dearer == cost + verify


def test_bench_e2e_refuses_the_reference_backend(tiny_model, capsys):
    assert main(["bench", str(tiny_model), "--backend", "reference"]) != 0
    assert "times the cuda engine" in capsys.readouterr().err


def test_one_stream_batch_with_speculation_cancels_at_once(tiny_model):
    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as llm:
        batch = llm.batch(1)
        ids = llm.prepare(REPEATING)
        first, second = (batch.add(ids, SamplingParams(max_tokens=8)) for _ in range(2))
        assert [h for h, _ in batch.step() + batch.step()] == [first, first]
        assert llm.kv_pages_in_use > 0
        batch.cancel(first)  # closes its stream now: pages freed before any step
        assert llm.kv_pages_in_use == 0 and batch.has_work
        out = []
        while batch.has_work:
            out += batch.step()
        assert {h for h, _ in out} == {second} and out[-1][1].finish_reason == "length"
        assert len(out) == 8 and out[-1][1].speculative is not None


def test_batch_ends_a_generation_its_backend_ended(tiny_model):
    """A solo generate() that stops before max_tokens without a stop id (LLM.stream's
    text.end() case) still gives its request a last delta, finish_reason "length"."""
    with LLM(tiny_model, backend="reference", max_context=512, speculative="ngram") as llm:
        full = llm.backend.generate

        def three(ids, params, stop_ids):
            tokens = full(ids, params, stop_ids)
            try:
                yield from itertools.islice(tokens, 3)
            finally:
                tokens.close()

        llm.backend.generate = three
        batch = llm.batch()
        handle = batch.add(llm.prepare(REPEATING), SamplingParams(max_tokens=8))
        out = []
        while batch.has_work:
            out += batch.step()
        assert [h for h, _ in out] == [handle] * 4 and out[-1][1].finish_reason == "length"
        assert sum(len(d.token_ids) for _, d in out) == 3 and out[-1][1].speculative is not None
        assert llm.kv_pages_in_use == 0
