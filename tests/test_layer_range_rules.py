"""The generator's rules on small graph bodies (native/layer_range_gen.py).

The generated patch itself is checked by test_architectures.py (the committed files are current)
and its effect by the exactness suites; these tests pin what each rule does to the C++ text it is
given, including the texts it must refuse.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "native"))

import layer_range_gen as gen  # noqa: E402

LOOP = "    for (int il = il_start; il < il_end; ++il) {\n        inpL = cur;\n    }\n"


def guard(prelude: str) -> tuple[str, list[str]]:
    body = "    inpL = build_inp_embd(model.tok_embd);\n" + prelude + LOOP
    return gen.guard_input_transforms(body, body.index("    for (int il"))


def test_a_position_embedding_runs_on_the_first_stage_only() -> None:
    new, findings = guard(
        "    ggml_tensor * inp_pos = build_inp_pos();\n"
        "    auto * inp_attn = build_attn_inp_kv();\n"
        "\n"
        "    ggml_tensor * pos = ggml_get_rows(ctx0, model.pos_embd, inp_pos);\n"
        "    cb(pos, \"pos_embd\", -1);\n"
        "    inpL = ggml_add(ctx0, inpL, pos);\n"
        "    cb(inpL, \"inpL\", -1);\n"
        "\n"
        "    ggml_tensor * inp_out_ids = build_inp_out_ids();\n"
    )
    assert findings == []
    assert new.count(gen.STAGE_FIRST) == 1
    guarded = new[new.index(gen.STAGE_FIRST):new.index("\n    }\n")]
    assert "model.pos_embd" in guarded and "ggml_add" in guarded and 'cb(inpL, "inpL"' in guarded
    assert "build_inp_pos" not in guarded and "build_inp_out_ids" not in guarded


def test_what_only_feeds_a_transform_joins_it() -> None:
    new, _ = guard(
        "    ggml_tensor * inp_pos = build_inp_pos();\n"
        "    ggml_tensor * pos = ggml_get_rows(ctx0, model.pos_embd, inp_pos);\n"
        "    inpL = ggml_add(ctx0, inpL, pos);\n"
        "    auto * inp_attn = build_attn_inp_kv();\n"
    )
    guarded = new[new.index(gen.STAGE_FIRST):new.index("\n    }\n")]
    assert "build_inp_pos" in guarded and "build_attn_inp_kv" not in guarded


def test_separate_transforms_are_guarded_separately_and_nothing_moves() -> None:
    prelude = (
        "    inpL = ggml_scale(ctx0, inpL, 2.0f);\n"
        "    auto * inp_attn = build_attn_inp_kv();\n"
        "    if (model.tok_norm) {\n"
        "        inpL = build_norm(inpL, model.tok_norm, nullptr, LLM_NORM, 0);\n"
        "    }\n"
    )
    new, findings = guard(prelude)
    assert findings == []
    assert new.count(gen.STAGE_FIRST) == 2
    order = [new.index(s) for s in ("ggml_scale", "build_attn_inp_kv", "build_norm")]
    assert order == sorted(order)


def test_no_transform_leaves_the_body_alone() -> None:
    body = "    inpL = build_inp_embd(model.tok_embd);\n    auto * inp_attn = build_attn_inp_kv();\n" + LOOP
    assert gen.guard_input_transforms(body, body.index("    for (int il")) == (body, [])


def test_a_name_declared_by_a_transform_and_read_later_is_refused() -> None:
    with pytest.raises(gen.TransformError, match="`scaled`, declared by an input transform, is read after it"):
        guard(
            "    ggml_tensor * scaled = inpL = ggml_scale(ctx0, inpL, 2.0f);\n"
            "    auto * inp_attn = build_attn_inp_kv(scaled);\n"
        )


def test_an_embedding_the_layers_read_is_an_inherent_refusal() -> None:
    body = ("    inpL = build_inp_embd(model.tok_embd);\n    ggml_tensor * skip = inpL;\n"
            "    for (int il = il_start; il < il_end; ++il) {\n        cur = ggml_add(ctx0, cur, skip);\n"
            "        inpL = cur;\n    }\n")
    with pytest.raises(gen.InherentRefusal, match="input-embedding skip.*`skip`"):
        gen.guard_input_transforms(body, body.index("    for (int il"))


def test_another_read_of_the_embedding_is_reported() -> None:
    _, findings = guard("    ggml_tensor * copy = ggml_cont(ctx0, inpL);\n    cb(copy, \"copy\", -1);\n")
    assert findings == ["reads the input embedding `inpL` before the layer loop (a later stage has hidden state there)"]


@pytest.mark.parametrize(
    ("block", "ends"),
    [
        ("x = f(inpL);\n inpL = cur;\n", True),
        ("inpL = ggml_add(ctx0, cur, ffn_inp);\n inpL = build_cvec(inpL, il);\n cb(inpL, \"l_out\", il);\n", True),
        ("if (par) {\n  inpL = a;\n} else {\n  cb(b, \"b\", il);\n  inpL = b;\n}\n", True),
        ("if (p) { inpL = a; } else if (q) { inpL = b; } else { inpL = c; }\n", True),
        # a conditional re-assignment after an assignment (Nanbeige's norm between loops)
        ("inpL = cur;\n if (loop_end) {\n  inpL = build_norm(inpL);\n}\n", True),
        ("cur = x;\n if (loop_end) {\n  inpL = build_norm(cur);\n}\n", False),  # no else, no assignment before
        ("if (p) { inpL = a; } else if (q) { inpL = b; }\n", False),  # not exhaustive
        ("if (p) { inpL = a; } else { cur = b; }\n", False),
        ("inpL = cur;\n cur = ggml_scale(ctx0, cur, 2.0f);\n", False),
        ("cb(cur, \"x\", il);\n", False),
    ],
)
def test_a_layer_loop_must_end_assigning_the_hidden_state_on_every_path(block: str, ends: bool) -> None:
    assert gen.ends_assigning(block, "inpL") is ends


LOADER = """void llama_model_x::load_arch_tensors(llama_model_loader &) {
    tok_embd = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {n_embd, n_vocab}, 0);
    output_norm = create_tensor(tn(LLM_TENSOR_OUTPUT_NORM, "weight"), {n_embd}, 0);
%s}

llama_model_x::graph::graph(const llama_model & model, const llm_graph_params & params) : llm_graph_context(params) {
    ggml_tensor * cur;
    ggml_tensor * inpL;
    inpL = build_inp_embd(model.tok_embd);
%s    ggml_tensor * inp_out_ids = build_inp_out_ids();
    for (int il = 0; il < n_layer; ++il) {
        cur = build_norm(inpL, model.layers[il].attn_norm, NULL, LLM_NORM_RMS, il);
        if (il == n_layer - 1 && inp_out_ids) {
            cur = ggml_get_rows(ctx0, cur, inp_out_ids);
        }
        inpL = cur;
    }
    cur = build_norm(inpL, model.output_norm, NULL, LLM_NORM_RMS, -1);
    cur = build_lora_mm(model.tok_embd, cur);
    res->t_logits = cur;
}
"""


def model_file(loader_extra: str = "", prelude: str = "") -> str:
    return LOADER % (loader_extra, prelude)


def test_a_head_reading_the_token_embeddings_reads_the_duplicated_tied_head() -> None:
    new, findings = gen.transform(gen.Arch(enum="LLM_ARCH_X", name="x"), model_file())
    assert findings == []
    assert new.count(gen.TIED_HEAD[1]) == 1 and gen.TIED_HEAD[0] not in new
    assert new.count("TENSOR_DUPLICATED") == 1
    # the head is read after the stage boundary: only the last stage reaches it
    assert new.index("build_stage_boundary") < new.index(gen.TIED_HEAD[1])


def test_a_head_reading_the_token_embeddings_beside_a_loaded_output_is_refused() -> None:
    loads_output = '    output = create_tensor(tn(LLM_TENSOR_OUTPUT, "weight"), {n_embd, n_vocab}, 0);\n'
    with pytest.raises(gen.TransformError, match="head reads model.tok_embd"):
        gen.transform(gen.Arch(enum="LLM_ARCH_X", name="x"), model_file(loader_extra=loads_output))


def test_layers_chosen_by_the_input_modality_read_the_token_ids_on_every_stage() -> None:
    modality = "    bool is_text;\n    if (ubatch.token) {\n        is_text = true;\n    } else {\n        is_text = false;\n    }\n"
    text = model_file(prelude=modality).replace(
        "cur = build_norm(inpL, model.layers[il].attn_norm,", "cur = build_norm(is_text ? inpL : cur, model.layers[il].attn_norm,"
    )
    arch = gen.Arch(enum="LLM_ARCH_X", name="x")
    new, findings = gen.transform(arch, text)
    # the modality test stays as it is: a later stage receives the ids of a text batch
    assert findings == [] and arch.token_input == gen.TOKEN_IDS
    assert new.count("if (ubatch.token) {") == 1 and gen.STAGE_FIRST not in new
    # another read of ubatch.token is still a finding
    _, findings = gen.transform(arch, text.replace("    ggml_tensor * inp_out_ids", "    bool other = ubatch.token != nullptr;\n    ggml_tensor * inp_out_ids"))
    assert findings == ["uses ubatch.token outside the layer loop"]


def test_layers_reading_the_input_embedding_embed_the_token_ids_on_every_stage() -> None:
    skip = "    inpL = build_norm(inpL, nullptr, nullptr, LLM_NORM_RMS, -1);\n    ggml_tensor * embd_skip = inpL;\n"
    text = model_file(prelude=skip).replace("        inpL = cur;\n", "        inpL = ggml_add(ctx0, cur, embd_skip);\n")
    arch = gen.Arch(enum="LLM_ARCH_X", name="x")
    new, findings = gen.transform(arch, text)
    assert findings == [] and arch.token_input == gen.TOKEN_EMBEDDINGS
    # the input norm is not guarded: every stage computes it on the token embeddings it looks up,
    # and a later stage's layers then start from the hidden state it received
    assert gen.STAGE_FIRST not in new
    assert new.count("build_stage_tok_embd(model.tok_embd,") == 1
    hidden = new.index(gen.SKIP_HIDDEN.format(var="inpL"))
    assert new.index("ggml_tensor * embd_skip = inpL;") < hidden < new.index(gen.LOOP_NEW)


def test_an_embedding_of_computed_ids_is_the_first_stages_and_a_router_reads_the_ids() -> None:
    """Granite Switch's shape: the input embeds ids the graph computes (adapter substitutes), then
    scales them; a router attention at hparams.router_layer picks the layers' adapters."""
    embd = "    inpL = ggml_get_rows(ctx0, model.tok_embd, sub_tokens);\n"
    prelude = ("    inpL = ggml_scale(ctx0, inpL, 12.0f);\n"
               "    const int R = hparams.router_layer;\n"
               "    ggml_tensor * ids = build_attn(inp_attn, nullptr, nullptr, nullptr, q, k, v, nullptr, nullptr, nullptr, 1.0f, R);\n")
    text = model_file(prelude=prelude).replace("    inpL = build_inp_embd(model.tok_embd);\n", embd)
    text = text.replace("cur = build_norm(inpL,", "cur = build_norm(ggml_add(ctx0, inpL, ids),")
    arch = gen.Arch(enum="LLM_ARCH_X", name="x")
    new, findings = gen.transform(arch, text)
    assert findings == [] and arch.token_input == gen.TOKEN_IDS
    lookup = "    inpL = il_start == 0 ? ggml_get_rows(ctx0, model.tok_embd, sub_tokens) : build_inp_embd(nullptr);"
    assert new.count(lookup) == 1
    # the scale is an input transform (first stage only); the router runs on every stage
    guarded = new.index(gen.STAGE_FIRST)
    assert guarded < new.index("ggml_scale") < new.index("hparams.router_layer")
    assert new.count(gen.STAGE_FIRST) == 1 and "}\n    const int R" in new
    # without the router, the ids are not needed past the first stage
    arch = gen.Arch(enum="LLM_ARCH_X", name="x")
    gen.transform(arch, text.replace("hparams.router_layer", "0"))
    assert arch.token_input == 0
    # two lookups of computed ids: refused
    twice = text.replace(embd, embd + "    ggml_tensor * other = ggml_get_rows(ctx0, model.tok_embd, more_ids);\n")
    with pytest.raises(gen.TransformError, match="more than one input embedding"):
        gen.transform(gen.Arch(enum="LLM_ARCH_X", name="x"), twice)
