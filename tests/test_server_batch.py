"""The server decoding several requests at once (continuous batching), in process, on the tiny
synthetic model (reference backend): concurrent streamed completions, greedy and seeded, some
cut by a stop string, each get exactly the text the same request gets alone from
LLM.generate, while the batch really held several of them; every KV page is free afterwards.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytest.importorskip("fastapi")  # the serve extra; a GPU image may lack it

from nanoqwen.llm import LLM, Batch  # noqa: E402
from nanoqwen.sampling import SamplingParams  # noqa: E402
from nanoqwen.server import Worker, create_app  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def llm(tiny_model):
    with LLM(tiny_model, backend="reference", max_context=512, max_batch=4,
             speculative="off") as llm:  # fmt: skip
        yield llm


def requests(llm: LLM) -> list[tuple[dict, SamplingParams]]:
    """Six completion bodies and their SamplingParams; two stop on a string the request's
    unstopped text contains (found by generating it alone first)."""
    out = []
    for i in range(6):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=6 + i)
        body = {"model": "tiny", "prompt": f"def f{i}(x):" + " y" * (i * 5),
                "max_tokens": params.max_tokens, "temperature": params.temperature,
                "seed": i, "stream": True}  # fmt: skip
        if i in (1, 4):
            text = llm.generate(llm.prepare(body["prompt"]), params).text
            stop = text[len(text) // 2 : len(text) // 2 + 2]
            if stop:
                body["stop"] = [stop]
                params = SamplingParams(params.temperature, seed=i, max_tokens=params.max_tokens,
                                        stop=(stop,))  # fmt: skip
        out.append((body, params))
    return out


def streamed_text(body: str) -> tuple[str, str]:
    """(text, finish_reason) of an SSE completion stream."""
    chunks = [json.loads(line[6:]) for line in body.split("\n\n") if line.startswith("data: {")]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1]
    return text, finish


def test_concurrent_streams_equal_each_request_alone(llm, monkeypatch):
    widest = [0]
    step = Batch.step

    def spy(self):
        widest[0] = max(widest[0], len(self.scheduler.running))
        return step(self)

    monkeypatch.setattr(Batch, "step", spy)
    reqs = requests(llm)

    async def main() -> list[httpx.Response]:
        worker = Worker(llm, max_queue=8)
        worker.start()
        try:
            transport = httpx.ASGITransport(app=create_app(llm, worker))
            async with httpx.AsyncClient(transport=transport, base_url="http://t",
                                         timeout=60) as client:  # fmt: skip
                return await asyncio.gather(
                    *(client.post("/v1/completions", json=body) for body, _ in reqs)
                )
        finally:
            worker.stop()

    assert sum("stop" in body for body, _ in reqs) == 2  # the stop-string path runs
    responses = asyncio.run(main())
    assert widest[0] >= 3, widest  # the requests really shared the batch
    for (body, params), response in zip(reqs, responses, strict=True):
        assert response.status_code == 200, response.text
        alone = llm.generate(llm.prepare(body["prompt"]), params)
        assert streamed_text(response.text) == (alone.text, alone.finish_reason), body
        assert ("stop" in body) == (alone.finish_reason == "stop")
    assert llm.kv_pages_in_use == 0
