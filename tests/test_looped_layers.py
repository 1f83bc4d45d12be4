"""A looped model's layer slots (issue 26, patch 0011): Nanbeige runs its file's blocks num_loops
times, one layer slot (and KV) per run. A range counts slots, a stage loads the blocks its slots run
(the exactness suite checks the splits), and the plan counts each block a stage holds once.
"""

from __future__ import annotations

import pytest
from skippy.deploy.plan import ModelShape
from skippy.models import ensure_model, tiny
from skippy.runtime import LayerRange, Model
from skippy.runtime.errors import LayerRangeError, ModelLoadError


def test_a_looped_model_has_a_layer_per_run_of_a_block() -> None:
    spec = tiny("nanbeige")
    assert (spec.n_layer, spec.num_loops) == (2, 2)
    path = ensure_model(spec)
    shape = ModelShape.from_gguf(path)
    assert shape.n_layer == 4 and shape.layer_period == 2
    block = shape.layer_bytes[0]
    assert shape.layer_bytes == (block,) * 4
    # slots 1 and 2 run blocks 1 and 0; slots 0..3 run each block twice, held once
    assert shape.layer_weight_bytes(1, 3) == 2 * block == shape.layer_weight_bytes(0, 4)
    assert shape.layer_weight_bytes(2, 3) == block
    with Model(path, LayerRange(3, 4)) as model:
        assert model.n_layer == 4


def test_a_range_past_the_slots_is_refused() -> None:
    path = ensure_model(tiny("nanbeige"))
    with pytest.raises((LayerRangeError, ModelLoadError), match="4"):
        Model(path, LayerRange(2, 5))
