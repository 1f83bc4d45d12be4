"""llama.cpp's ``samplers`` field mapped onto skippy's sampler chain (skippy/api/samplers.py).

The mapping is checked on its own (names, aliases, characters; left-out samplers neutral; identities;
orders skippy cannot run refused); then on a 2-stage chain of the tiny llama, an answer whose
``samplers`` leave out ``top_p`` and ``min_p`` equals the answer with those parameters neutral, and
differs from the answer with them applied, and a bad list is a 400 naming ``samplers``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from skippy.api.errors import ApiError
from skippy.api.samplers import apply_samplers
from skippy.runtime.sampling import SamplingParams

from stage_helpers import inprocess_chain

MODEL = "tiny"
SET = SamplingParams(temperature=0.7, top_k=20, top_p=0.5, min_p=0.1, repeat_penalty=1.1, seed=1)


@pytest.mark.parametrize(("samplers", "expected"), [
    (["penalties", "top_k", "top_p", "min_p", "temperature"], SET),
    ("ekpmt", SET),
    (["dry", "top-k", "typ_p", "nucleus", "minp", "xtc", "temp"],
     SamplingParams(temperature=0.7, top_k=20, top_p=0.5, min_p=0.1, seed=1)),  # penalties left out
    (["temperature"], SamplingParams(temperature=0.7, seed=1)),
    (["top_k"], SamplingParams(temperature=1.0, top_k=20, seed=1)),  # no temperature: the unscaled draw
    ([], SamplingParams(temperature=1.0, seed=1)),
])
def test_samplers_map_onto_the_chain(samplers: Any, expected: SamplingParams) -> None:
    assert apply_samplers(samplers, SET) == expected


@pytest.mark.parametrize(("samplers", "status"), [
    (["temperature", "top_p"], 400),  # temperature before top_p: not skippy's order
    (["top_p", "top_k"], 400),
    (["top_k", "top_k"], 400),
    (["infill"], 400),
    (["adaptive_p"], 400),
    (["warp"], 422),
    ("kz", 422),
    ({"top_k": 1}, 422),
])
def test_samplers_skippy_cannot_run_are_refused(samplers: Any, status: int) -> None:
    with pytest.raises(ApiError) as raised:
        apply_samplers(samplers, SET)
    assert (raised.value.param, raised.value.status) == ("samplers", status)


def test_an_order_of_neutral_samplers_does_not_matter() -> None:
    params = SamplingParams(temperature=0.7, top_k=20, seed=1)  # top_p, min_p neutral
    assert apply_samplers(["min_p", "top_k", "top_p", "temperature"], params) == params
    with pytest.raises(ApiError):  # the two active ones out of skippy's order
        apply_samplers(["temperature", "top_k"], params)


async def test_samplers_on_a_chain(tiny_llama: Path) -> None:
    from skippy.api.app import ChainService, create_app
    from skippy.api.lanes import LanePool
    from skippy.driver.generator import Generator
    from skippy.runtime.tokenizer import Tokenizer

    generator = Generator(Tokenizer(tiny_llama), n_ctx=512, chunk_size=16)
    ask = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 1.3, "top_k": 40,
           "seed": 9}
    try:
        async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=512) as servers:
            pool = LanePool(servers[0].address, max_lanes=1)
            app = create_app(ChainService(generator, pool, MODEL))
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://skippy",
                                         timeout=60) as http:
                async def text(**fields: Any) -> str:
                    response = await http.post("/v1/completions", json={**ask, **fields})
                    assert response.status_code == 200, response.text
                    return str(response.json()["choices"][0]["text"])
                neutral = await text()
                ordered = await text(top_p=0.3, min_p=0.2, samplers=["top_k", "temperature"])
                filtered = await text(top_p=0.3, min_p=0.2)
                bad = await http.post("/v1/completions", json={**ask, "top_p": 0.3, "samplers": "tpk"})
            await pool.aclose()
    finally:
        generator.close()
    assert ordered == neutral != filtered
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "samplers"
