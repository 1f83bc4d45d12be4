"""llama-cpp-python runs on skippy's patched libllama and agrees with the runtime bitwise."""

from __future__ import annotations

import numpy as np
import pytest

from chain_helpers import InProcessChain
from conftest import PROMPT, model_path

reference = pytest.importorskip("skippy.reference")


def test_llama_cpp_is_bound_to_the_patched_library() -> None:
    llama_cpp = reference.import_llama_cpp()
    assert hasattr(llama_cpp.llama_cpp._lib, "llama_model_stage_layer_start")


@pytest.mark.slow
def test_reference_generates_and_matches_the_split_chain() -> None:
    path = model_path("qwen3")
    llm = reference.load_reference(path, n_ctx=256, n_batch=64, threads=2)
    llm.eval(PROMPT)
    ref_logits = np.array(llm.scores[: len(PROMPT)], dtype=np.float32)
    with InProcessChain(path, [(0, 2), (2, 4)]) as chain:
        got = chain.decode(PROMPT, list(range(len(PROMPT))), [0] * len(PROMPT), [True] * len(PROMPT))
    assert np.array_equal(np.stack(got), ref_logits)
    # and it still generates through its own high-level API
    text = llm.create_completion("Hello", max_tokens=4, temperature=0.0)["choices"][0]["text"]
    assert isinstance(text, str) and len(text) > 0
    llm.close()  # free it now, not during interpreter shutdown
