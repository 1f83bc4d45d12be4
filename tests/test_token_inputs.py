"""Token ids on every stage for the layers that read them (issue 26, patch 0010).

CogVLM's layers pick text or vision-expert weights by whether the batch holds tokens, Talkie's add
the normalised input embedding: a later stage receives the token ids beside the hidden state (and
Talkie's loads the token embeddings to embed them). The exactness suite checks the splits; these
check that a later stage refuses a batch without the ids, in Python and in the patched library,
and what each stage loads.
"""

from __future__ import annotations

import numpy as np
import pytest
from skippy.deploy.plan import ModelShape
from skippy.models import ensure_model, tiny
from skippy.runtime import InvalidBatch, LayerRange, Model, StageContext


@pytest.mark.parametrize("arch", ["cogvlm", "talkie"])
def test_a_later_stage_needs_the_token_ids(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    path = ensure_model(tiny(arch))  # type: ignore[arg-type]
    with Model(path, LayerRange(2, 4)) as model, StageContext(model, n_ctx=64, max_sessions=1, n_batch=8, threads=1) as ctx:
        assert model.reads_tokens
        hidden = np.zeros((2, model.n_embd), dtype=np.float32)
        with pytest.raises(InvalidBatch, match="needs the token ids beside the activations"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        monkeypatch.setattr(ctx, "_reads_tokens", False)  # the context reads it once, at creation
        with pytest.raises(InvalidBatch, match="this architecture needs the token ids"):
            ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden)
        monkeypatch.undo()
        ctx.decode(positions=[0, 1], seq_ids=[0, 0], activations=hidden, tokens=[1, 2])


def test_only_an_embedding_reader_holds_the_token_embeddings_on_later_stages() -> None:
    talkie, cogvlm = (ModelShape.from_gguf(ensure_model(tiny(a))) for a in ("talkie", "cogvlm"))  # type: ignore[arg-type]
    assert talkie.reads_tokens and not cogvlm.reads_tokens
    with Model(ensure_model(tiny("talkie")), LayerRange(2, 4)) as model:
        assert model.info.embeds_tokens
    with Model(ensure_model(tiny("cogvlm")), LayerRange(2, 4)) as model:
        assert model.reads_tokens and not model.info.embeds_tokens
