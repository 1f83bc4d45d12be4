"""The HTTP API over a 3-stage hybrid chain (issue 25, checked by): stage processes of the tiny
Qwen3.5- and Nemotron-H-shaped models, cut inside a run of recurrent layers and between a
recurrent and an attention layer ([0:1) [1:3) [3:4)), 1 thread.

* A completion whose prompt extends an earlier one hits the prefix cache: its usage reports
  ``prompt_tokens_details.cached_tokens > 0`` (whole pages of the earlier prompt; a recurrent
  state is restored at the end of a recorded entry) and its text is the uncached answer's.
* ``n = 4`` (greedy) equals four ``n = 1`` requests: the prompt is prefilled once and forked on
  every stage (the parent rolled back one position, recurrent state included), with direct
  return off and on.

Speculation on a looping continuation, seeded ``n = 4`` and decode runs ended early, over the
same chain of stage processes, are in test_recurrent_processes.py.

The driver-level twins of these checks are in test_recurrent_chain.py (in-process stage servers);
here the requests go through the API's request handling, lanes and the stage processes' wire.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio

from skippy.api.server import serve_api
from skippy.models import ensure_model, tiny

from stage_helpers import stage_chain
from test_recurrent_rollback import HYBRIDS

pytestmark = pytest.mark.slow

MODEL = "tiny-hybrid"
SPLITS = ["0:1", "1:3", "3:4"]
#: About 150 tokens of the llama-spm vocabulary: two 64-token cache pages and some.
PROMPT = ("Once upon a time, in a small village by the sea, there lived an old fisherman who "
          "mended his nets every morning and told the children stories of storms and whales. ") * 3
FOLLOW_UP = " The children listened, and one of them asked him"


@pytest.mark.parametrize("direct_return", ["off", "auto"])
@pytest.mark.parametrize("arch", HYBRIDS)
async def test_prefix_cache_hit_and_n_choices_on_a_hybrid_chain(arch: str, direct_return: str,
                                                                tmp_path: Path) -> None:
    model = ensure_model(tiny(arch))
    async with stage_chain(str(model), SPLITS, tmp_path, ["--ctx-size", "512", "--threads", "1"]) as stages:
        assert stages[0].address is not None
        async with trio.open_nursery() as nursery:
            url = await nursery.start(functools.partial(
                serve_api, model, stages[0].address, port=0, n_ctx=512, max_lanes=2, model_id=MODEL,
                direct_return=direct_return, final_stage=stages[-1].address))
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                async def complete(**fields: Any) -> dict[str, Any]:
                    body = {"model": MODEL, "max_tokens": 8, "temperature": 0, **fields}
                    response = await http.post("/v1/completions", json=body)
                    assert response.status_code == 200, response.text
                    return response.json()  # type: ignore[no-any-return]

                recorded = await complete(prompt=PROMPT)
                cached = await complete(prompt=PROMPT + FOLLOW_UP)
                uncached = await complete(prompt=PROMPT + FOLLOW_UP, prefix_cache=False)
                singles = [await complete(prompt=PROMPT, prefix_cache=False) for _ in range(4)]
                four = await complete(prompt=PROMPT, n=4, prefix_cache=False)
            nursery.cancel_scope.cancel()
    assert recorded["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, cached["usage"]
    assert uncached["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert cached["choices"][0]["text"] == uncached["choices"][0]["text"]
    assert cached["usage"]["completion_tokens"] == uncached["usage"]["completion_tokens"] > 0
    assert singles[0]["choices"][0]["text"] == recorded["choices"][0]["text"]
    texts = [choice["text"] for choice in four["choices"]]
    assert [choice["index"] for choice in four["choices"]] == [0, 1, 2, 3]
    assert texts == [single["choices"][0]["text"] for single in singles]
