"""Generate the per-architecture half of skippy's layer-range patch from the pinned llama.cpp tree.

Strategy: the hand-written patch ``0001-layer-range-execution.patch`` adds the mechanism (the layer
range in the hparams, tensor and KV filtering, the embd-only input, ``build_stage_boundary``).  What
remains per architecture is always the same three edits to its graph builder in
``src/models/<file>.cpp``, so they are made here by rules instead of by hand:

1. the layer loop ``for (int il = 0; il < n_layer; ++il)`` runs ``il_start .. il_end``;
2. the "last layer" test ``il == n_layer - 1`` (where the output rows are selected) becomes
   ``il == il_end - 1``, and tests for the output ids where it did not (a stage that is not the
   last keeps every row and has none);
3. right after the layer loop, a stage that is not the last publishes the pre-norm hidden state
   (``inpL``, which every path through such a loop ends by assigning, however it is written: a
   last assignment followed by ``cb`` calls, or an exhaustive if/else whose branches all assign)
   and stops building the graph.

The graph is the arch's own, or the one it reuses (``using graph = llama_model_X::graph``, or a
subclass that overrides nothing), edited once for every architecture sharing it.  Generic edits
follow: an input transform between the embedding and the layer loop (a position embedding added,
an input norm, a scale) is guarded to run on the first stage only; the glm4 families' refusal of
embedding input (which every later stage receives) is limited to the first stage; a head reading
``model.tok_embd`` reads ``model.output``, loaded as the duplicated tied head.  Every edit must
match an exact number of times (``ARCH_EDITS`` holds reviewed
per-architecture ones), and after editing, the main graph body is linted for the constructs that
would make a split wrong (another use of ``n_layer``, the token embeddings, the raw input
embeddings, the batch's token/embd pointers); each remaining use must be listed as reviewed in
``REVIEWED``.  Architectures whose graph the rules cannot transform, or whose model has a feature
that a layer range cannot carry (layers reused in depth in a hierarchical recurrence, an encoder),
are refused with that reason.  A residual stream wider than the hidden state (hyper-connections:
``HYPER``) or banked across layers (Kimi-K3: ``BANKED``) crosses a wide boundary whose width the
protocol's boundary-rows extension announces (patch ``0013``).  Layers that read the input
embedding or pick their weights by the input modality split with the token ids on every stage
(``TOKEN_IDS`` / ``TOKEN_EMBEDDINGS``, patch ``0010``), and so do layers that apply the adapter a
router picks from the token ids (Granite Switch: every stage runs the router, ``ROUTER``, on KV
cells of its own, patch ``0014``); a value residual from the first layer (RWKV-7) or parallel
streams (Gemma 3n's AltUp) cross a wide boundary announced by the protocol's sideband flags (patch
``0012``).  Recurrent state (conv / SSM / WKV / delta-net) is not such a
feature: it belongs to its layer, and patch ``0005`` gives a range the state of its own layers.
So are the few the rules reach that cannot split for a reason of the model itself (``INHERENT``:
e.g. a TTS backbone without an LM head).  Nor is a value residual (RWKV-7's ``v_first``, the first
layer's values every layer mixes in) or a fixed set of parallel residual streams (Gemma 3n's AltUp):
the boundary is made wide (patch ``0012``), each row carrying the sideband after the hidden state (or
a token's streams side by side), and ``src/llama-stage-archs.inc`` tells the loader how many
n_embd-wide parts a row of such an architecture holds.

Only architectures in ``SPLIT`` (each covered by a synthetic writer and the exactness suite) get
their hunks; the rest are refused at load time with the reason the classifier found.  The script
writes:

- ``native/patches/0002-layer-range-architectures.patch``: the model-file hunks plus a new file
  ``src/llama-stage-archs.inc`` holding the refusal reason of every architecture, which the core
  patch's loader consults;
- ``skippy/runtime/_architectures.py``: the same table for the Python side (errors before loading);
- ``docs/architectures.md``: the table for people.

``--check`` regenerates everything in memory and fails when a committed file differs.

Usage: ``python native/layer_range_gen.py [--check] [--source TREE]``
"""

from __future__ import annotations

import argparse
import difflib
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "native"))

import build as native_build  # noqa: E402  (native/build.py: the pinned tree)

PATCH_PATH = ROOT / "native" / "patches" / "0002-layer-range-architectures.patch"
PY_TABLE_PATH = ROOT / "skippy" / "runtime" / "_architectures.py"
DOCS_PATH = ROOT / "docs" / "architectures.md"
INC_NAME = "src/llama-stage-archs.inc"

#: Architectures that split (tested): hunks are generated for them and the loader accepts a range.
SPLIT: tuple[str, ...] = (
    "llama", "qwen2", "qwen3",
    "gemma2", "gemma3", "phi3", "mistral3", "olmo2", "granite", "glm4",
    "qwen2moe", "qwen3moe", "gpt-oss", "glm4moe", "deepseek2",
    "gemma", "olmoe", "smollm3", "exaone4", "ernie4_5", "starcoder2", "cohere2", "seed_oss",
    "llama4", "minimax-m2", "dots1", "ernie4_5-moe",
    "phi2", "exaone", "bailingmoe2", "stablelm", "olmo", "arcee", "command-r", "hunyuan-moe", "nemotron", "internlm2",
)
# Each group below is one body of work (issues 25 and 26); keep a group's names in its own block.
#
#: Issue 25, SSM state (Mamba layers; pure and hybrid): patch 0005 owns the state per range.
SPLIT += ("nemotron_h", "mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h_moe", "plamo2")
#
#: Issue 25, linear attention (gated delta-net, KDA, lightning attention) and hybrids of it.
SPLIT += ("qwen35", "qwen35moe", "qwen3next", "minimax-01", "kimi-linear", "bailingmoe3")
#
#: Issue 25, RWKV and short-convolution families.
SPLIT += ("lfm2", "rwkv6", "rwkv6qwen2", "lfm2moe")
#
#: Issue 26, dense families the layer-loop rules already covered (writers and exactness added).
SPLIT += (
    "baichuan", "xverse", "orion", "refact", "qwen", "codeshell", "plamo", "falcon", "maincoder",
    "pangu-embedded", "chatglm", "jais", "hunyuan_vl", "chameleon", "plamo3", "mellum", "apertus",
    "spark2_5", "maple", "qwen2vl", "paddleocr", "plm", "openelm", "deci", "laguna",
)
#
#: Issue 26, MoE and sparse-attention families the layer-loop rules already covered.
SPLIT += (
    "deepseek", "dbrx", "grok", "arctic", "cohere2moe", "exaone-moe", "bailingmoe", "grovemoe",
    "hy_v3", "deepseek32", "glm-dsa", "step35", "dots3note", "minimax-m3",
)
#
#: Issue 26, families the grown rules cover (input transforms, loops written differently).
SPLIT += ("gpt2", "starcoder", "bloom", "mpt", "gptneox", "jais2", "granitemoe", "minicpm", "phimoe",
          "hunyuan-dense", "mistral4", "smallthinker", "muse-glimmer",
          "deepseek2-ocr", "afmoe", "granite_swa", "mimo2",
          "minicpm3", "bitnet")
#
#: Issue 26, per-layer token embeddings and cross-layer KV sharing.
SPLIT += ("gemma4",)
#
#: Issue 26, per-token adapter switching: every stage runs the adapter router from the token ids.
SPLIT += ("graniteswitch",)
#
#: Issue 26, token inputs on every stage and layers reused in depth (M-RoPE text towers first:
#: patch 0008 gives a later stage the text positions; Qwen3-TTS's talker samples codec tokens).
SPLIT += ("qwen3vl", "qwen3vlmoe", "qwen3tts")
#: ... and the layers that read the token ids (their modality: cogvlm) or the input embedding
#: (talkie): every later stage receives the ids beside the hidden state (patch 0010).
SPLIT += ("cogvlm", "talkie")
#: ... and a looped model: its layer slots run the file's blocks num_loops times (patch 0011).
SPLIT += ("nanbeige",)
#
#: Issues 25/26, wide stage boundaries: a sideband beside the hidden state (patch 0012).
SPLIT += ("rwkv7", "arwkv7", "gemma3n")
#
#: Issues 25/26, hyper-connections: hc_mult residual streams across the boundary (patch 0013).
SPLIT += ("deepseek4", "hy_v4", "glm5-next")
#: ... and n-gram input embeddings hashed from the cells' token record (issue 26: qwen4exp).
SPLIT += ("qwen4exp",)
#: ... and banked layer inputs, as many rows as the cut is deep (Kimi-K3, patch 0013).
SPLIT += ("kimi-k3",)

#: Architectures whose graph the rules would transform but which cannot be split for a reason of
#: the model itself, with that reason (refused at load time like the rest).
INHERENT: dict[str, str] = {}
#
#: Issue 26, dense.
INHERENT |= {
    "pockettts": (
        "not a text-generation model: the Pocket TTS backbone has no LM head (its logits are unused);"
        " its final hidden states feed the audio flow network in the mmproj, which a stage chain"
        " (ending in logits and sampled tokens) does not run"
    ),
}

#: Extra literal edits per architecture name: (old, new, expected count).
ARCH_EDITS: dict[str, list[tuple[str, str, int]]] = {
    # Qwen3-VL's head compares the embedding's rows with the head's (Qwen3-TTS pads a codec head);
    # the last stage has no token embeddings, and its loader makes them n_vocab rows: the same.
    "qwen3vl": [("int64_t n_vocab_in  = model.tok_embd->ne[1];",
                 "int64_t n_vocab_in  = (int64_t) model.vocab.n_tokens(); // skippy: tok_embd's rows", 1)],
}
#: Issue 26, MoE / sparse attention: MiniMax-M3 builds its sparse-attention (MSA) inputs before
#: the layer loop for the layers past the leading dense ones; a stage holding dense layers only
#: would leave them unallocated (and setting them fails), so it runs as MSA-less, which changes
#: nothing for dense layers (they never read those inputs).
ARCH_EDITS["minimax-m3"] = [(
    "const bool msa_enabled = fa_on && streams_ok;",
    "const bool msa_enabled = fa_on && streams_ok && il_end > (int) hparams.n_layer_dense_lead; "
    "// skippy: a stage of dense layers only has no sparse one",
    1,
)]

#: Generic edit: an input transform between the embedding and the layer loop (a position
#: embedding added, an input norm, a scale) belongs to the first stage, whose input is the
#: embedding; a later stage's input is hidden state that already went through it (and the
#: transform's own tensors, LLM_TENSOR_LAYER_INPUT, are loaded on the first stage only).
STAGE_FIRST = "if (il_start == 0) { // skippy: the input transform runs on the first stage only"

#: Generic edit to a loader: an assertion that each layer has one of two tensors (RWKV-6: fused or
#: separate lerps) holds for the stage's own layers only; the others' tensors are never created.
LOADER_EITHER = re.compile(r"GGML_ASSERT\(!\((layer\.\w+ == NULL && layer\.\w+ == NULL)\)\);")
LOADER_EITHER_NEW = r"GGML_ASSERT(!hparams.in_stage(i) || !(\1)); // skippy: other stages' layers are not loaded"

#: Reviewed literal edits of a model file outside the graph constructor (a model's own graph
#: inputs), per architecture: (old, new, expected count).
FILE_EDITS: dict[str, list[tuple[str, str, int]]] = {
    # Gemma 3n's per-layer inputs are n_embd_altup wide: the hparam patch 0006 keys on (every stage
    # loads the per-layer tensors and reads the token ids) says so
    "gemma3n": [(
        "    hparams.n_layer_kv_from_start = 20;\n",
        "    hparams.n_layer_kv_from_start = 20;\n"
        "    hparams.n_embd_per_layer      = hparams.n_embd_altup; // skippy: per-layer token inputs (0006)\n",
        1,
    )],
    # Granite Switch embeds the adapter-substituted ids on the first stage only (EMBD_ROWS): a later
    # stage's graph never reads that input, which is then left without a buffer
    "graniteswitch": [(
        "    ggml_backend_tensor_set(sub_tokens,  sub.data(),  0, n_tokens*ggml_element_size(sub_tokens));\n",
        "    if (sub_tokens->buffer) { // skippy: a later stage does not embed (its input is the hidden state)\n"
        "        ggml_backend_tensor_set(sub_tokens,  sub.data(),  0, n_tokens*ggml_element_size(sub_tokens));\n"
        "    }\n",
        1,
    )],
    # GLM-5 Next's k-pooled indexer inputs are built on every stage but used only by its DSA
    # layers: a stage holding none (KDA layers only) leaves them without a buffer
    "glm5-next": [(
        "    void set_input(const llama_ubatch * ubatch) override {\n"
        "        mctx->get_idx()->set_input_k_idxs(k_idxs, ubatch);\n",
        "    void set_input(const llama_ubatch * ubatch) override {\n"
        "        if (k_idxs->buffer == nullptr) {\n"
        "            return; // skippy: a stage without indexer layers\n"
        "        }\n"
        "        mctx->get_idx()->set_input_k_idxs(k_idxs, ubatch);\n",
        1,
    )],
    # lightning-attention inputs are built on every stage but used only by lightning layers: a
    # stage holding none leaves them without a buffer (as a hybrid's inputs of a missing kind)
    "minimax-01": [(
        "        // this operates on assumption that we have an equal ubatch split\n",
        "        // this operates on assumption that we have an equal ubatch split\n"
        "        if (inp_slopes == nullptr || inp_slopes->buffer == nullptr) {\n"
        "            return; // skippy: a stage without lightning-attention layers\n"
        "        }\n",
        1,
    )],
}


#: Generic edit: a head that multiplies by model.tok_embd (a tied head the loader never makes into
#: model.output) reads model.output, which the loader then creates as the duplicated tied head
#: (the same weights; TENSOR_DUPLICATED, as every other tied family's loader does), so the last
#: stage has it.
TIED_HEAD = ("build_lora_mm(model.tok_embd, cur)", "build_lora_mm(model.output, cur) /* skippy: tied head */")
TIED_HEAD_LOAD = (
    'output_norm = create_tensor(tn(LLM_TENSOR_OUTPUT_NORM, "weight"), {n_embd}, 0);\n',
    'output_norm = create_tensor(tn(LLM_TENSOR_OUTPUT_NORM, "weight"), {n_embd}, 0);\n'
    '    // skippy: the tied head as model.output, so that the last stage loads it\n'
    '    output = create_tensor(tn(LLM_TENSOR_TOKEN_EMBD, "weight"), {n_embd, n_vocab}, TENSOR_DUPLICATED);\n',
)

#: Generic edit: a refusal of embedding input (multimodal guards) applies to the first stage only.
EMBD_GUARD = ("if (ubatch.embd && ", "if (il_start == 0 && ubatch.embd && ")  # skippy: later stages take embd

#: Generic rule for per-layer token embeddings (Gemma 4): a stage past the first takes the hidden
#: state as its main input and, beside it, the token ids (patch 0006 loads the per-layer tensors and
#: the token embeddings on every stage); the token input's sqrt(n_embd) scale stays on the first
#: stage (the input-transform rule guards it), and a later stage projects its own scaled token
#: embeddings into the per-layer inputs.
PER_LAYER_EDITS: list[tuple[str, str, int]] = [
    ("inpL = build_inp_embd(model.tok_embd);",
     "inpL = build_inp_embd(il_start == 0 ? model.tok_embd : nullptr); // skippy: later stages take hidden states",
     1),
    ("inp_per_layer = project_per_layer_inputs(inpL, inp_per_layer);",
     "inp_per_layer = project_per_layer_inputs(il_start == 0 ? inpL : build_stage_tok_embd(model.tok_embd, sqrtf(n_embd)),"
     " inp_per_layer); // skippy: a later stage embeds the token ids itself",
     1),
    ("{slice}(ctx0, inp_per_layer, il)", "{slice}(ctx0, inp_per_layer, il - il_start)", 1),
]
#: ... and in the graph's helpers after it: the per-layer inputs are built for the stage's layers only
#: (build_stage_layer_slice, patch 0006: the stage's columns of the token table, rows of the projection).
PER_LAYER_HELPER_EDITS: list[tuple[str, str, int]] = [
    ("ggml_get_rows  (ctx0, model.per_layer_tok_embd, inp->tokens);",
     "ggml_get_rows  (ctx0, build_stage_layer_slice(model.per_layer_tok_embd, 0, {width}), inp->tokens);", 1),
    ("ggml_view_1d(ctx0, model.per_layer_tok_embd, embd_size, 0);",
     "ggml_view_1d(ctx0, build_stage_layer_slice(model.per_layer_tok_embd, 0, {width}), "
     "embd_size / n_layer * (il_end - il_start), 0); // skippy: the stage's layers", 1),
    ("ggml_mul_mat   (ctx0, model.per_layer_model_proj, inp_batch);",
     "ggml_mul_mat   (ctx0, build_stage_layer_slice(model.per_layer_model_proj, 1, {width}), inp_batch);", 1),
    ("inp_per_layer, {width}, n_layer,", "inp_per_layer, {width}, il_end - il_start,", 2),
    ("per_layer_proj, {width}, n_layer,", "per_layer_proj, {width}, il_end - il_start,", 1),
]
#: The names the per-layer edits are written over: the graph's slice helper (gemma4_view_2d_slice,
#: gemma3n_view_2d_slice) and its per-layer width (n_embd_per_layer; Gemma 3n: n_embd_altup).
PER_LAYER_SLICE = re.compile(r"\b(\w+_view_2d_slice)\(ctx0, inp_per_layer, il\)")
PER_LAYER_WIDTH = re.compile(r"ggml_reshape_3d\(ctx0, per_layer_proj, (\w+), n_layer,")

#: Generic rule for parallel residual streams (Gemma 3n's AltUp: the layers carry inpL as
#: [n_embd, n_tokens, n_altup]): the boundary is wide (patch 0012), each row carrying a token's
#: streams side by side; a later stage rebuilds the streams from its input rows before the loop
#: (the first stage builds them from the embedding, in its guarded input transforms).
STREAMS = re.compile(r"\bn_altup\b")
STREAMS_ROWS = 4  # llama.cpp's n_altup (src/llama-hparams.h), which the protocol's AltUp flag carries
STREAMS_IN = "inpL = build_stage_streams_in(inpL); // skippy: a later stage takes the streams as its input rows"

#: Generic rule for hyper-connections (DeepSeek V4, GLM-5 Next, HY V4, Qwen4-exp): the layers carry
#: hc_mult parallel residual streams as [n_embd, hc_mult, n_tokens] (a token's streams side by side,
#: the layout of one wide row).  The boundary is wide (patch 0012) with ``hparams.dsv4_hc_mult``
#: rows, which the protocol's boundary-rows extension announces (docs/protocol.md §12); a later
#: stage takes its streams from its input rows before the loop (patch 0013).
HYPER = re.compile(r"\bhparams\.dsv4_hc_mult\b")
HYPER_ROWS = 0  # Arch.stage_rows: the model's hyper-connection count (hparams.dsv4_hc_mult)
HYPER_IN = "{var} = build_stage_hc_in({var}); // skippy: a later stage takes the streams as its input rows"
#: ... the streams' variable: ``inpL``, or the one the graph names "hc_init" before the loop (Qwen4-exp's
#: ``res_hc``) when the loop ends by assigning it.
HYPER_INIT = re.compile(r'\bcb\((\w+), "hc_init", -1\);')
#: Generic rule for n-gram input embeddings (Qwen4-exp's PLE: rows hashed from each token and its
#: predecessors, an input built before the loop): the input reads the batch's token ids and the
#: predecessors the attention cells recorded (llama_kv_cache::apply_ubatch keeps each cell's token
#: whenever the batch has ids).  Every stage builds it (its layers' PLE modules read it): a later
#: stage receives the token ids (TOKEN_IDS, patch 0010), so its own cells record them as the first
#: stage's do, and its hashes are the first stage's.
NGRAM_INPUT = "build_inp_ple("
#: Generic rule for banked layer inputs (Kimi-K3's cross-layer residual attention: every
#: attn_res_block_size-th layer pushes its input onto the graph's `resi_stack`, which later layers
#: mix in): a cut at layer L hands on the hidden state and the ceil(L / block) rows banked so far
#: (patch 0013: the width depends on the cut), and a later stage takes both from its input rows.
BANKED = re.compile(r"\bresi_stack\b")
BANKED_ROWS = -1  # Arch.stage_rows: 1 + the rows banked before the boundary's layer
BANKED_IN = ("build_stage_banked_in({var}, resi_stack); // skippy: a later stage takes the hidden state "
             "and the banked rows from its input rows")
#: Layers that read the token ids themselves (DeepSeek V4's hash routing of the first
#: hash_layer_count layers: experts by token id): every later stage receives them (patch 0010).
TOKEN_READS = (("res->t_inp_tokens", "build_stage_inp_tokens()"),)
#: A modality test by the batch's input embeddings (a media batch has embeddings, no token ids): a
#: later stage's text batch holds both (the hidden state beside the ids), so the test reads the ids.
MEDIA_TEST = ("ubatch.embd != nullptr", "ubatch.token == nullptr")

#: What a stage past the first receives beside the hidden state (``Arch.token_input``; the loader
#: reads it from ``llm_arch_stage_token_input`` in the generated table, patch 0010): the token ids
#: (layers that pick their weights by the input modality: a text batch is text on every stage), or
#: the ids and the token embeddings, which such a stage loads (layers that read the input embedding).
TOKEN_IDS = 1
TOKEN_EMBEDDINGS = 2

#: Generic rule for layers that read the input embedding (an embedding skip: Talkie's `embd_skip`):
#: every stage computes the input transforms before the loop from the token ids exactly as the
#: first stage does (its own lookup of the token embeddings, scaled as build_inp_embd scales them),
#: and a later stage's layers then start from the hidden state it received.
SKIP_EMBD = re.compile(r"\b(\w+) = build_inp_embd\(model\.tok_embd\);")
SKIP_EMBD_NEW = (r"\1 = il_start == 0 ? build_inp_embd(model.tok_embd) : build_stage_tok_embd(model.tok_embd, "
                 r"hparams.f_embedding_scale != 0.0f ? hparams.f_embedding_scale : 1.0f); "
                 r"// skippy: every stage embeds the token ids for the layers' input-embedding reads")
SKIP_HIDDEN = "if (il_start > 0) {{ {var} = build_inp_embd(nullptr); }} // skippy: a later stage's layers start from the hidden state"

#: Constructs in a main graph body that need a human look, with the ones reviewed per architecture.
LINT = {
    "n_layer": re.compile(r"\bn_layer\b"),
    "tok_embd": re.compile(r"model\.tok_embd\b"),
    "t_inp_embd": re.compile(r"res->t_inp_embd\b"),
    "ubatch.token": re.compile(r"\bubatch\.token\b"),
    "ubatch.embd": re.compile(r"\bubatch\.embd\b"),
}
REVIEWED: dict[str, dict[str, str]] = {
    "gemma3": {"ubatch.token": "the sqrt(n_embd) scale is already applied to token input only"},
    "granite": {"t_inp_embd": "deepstack (vision) injection; the loader refuses a range when deepstack layers exist"},
    "granite_swa": {"t_inp_embd": "deepstack (vision) injection; the loader refuses a range when deepstack layers exist"},
    "qwen3vl": {"t_inp_embd": "deepstack (vision) injection; the loader refuses a range when deepstack layers exist"},
    "qwen3vlmoe": {"t_inp_embd": "deepstack (vision) injection; the loader refuses a range when deepstack layers exist"},
    "minicpm3": {"n_layer": "the residual scale scale_depth / sqrt(n_layer) is the model's depth, on every stage"},
    "smallthinker": {"n_layer": "n_no_rope_layer_step == n_layer (no NoPE layer) compares with the model's depth"},
    "mimo2": {"n_layer": "the MTP extraction of the final layer input (embeddings_layer_inp[n_layer]) is read "
                         "after the loop, on the last stage only"},
    "glm4": {"ubatch.embd": "the multimodal guard, limited to the first stage"},
    "glm4moe": {"ubatch.embd": "the multimodal guard, limited to the first stage"},
    "graniteswitch": {"ubatch.token": "the graph's assertion of token input: every stage receives the token ids "
                                      "(its router reads them, ROUTER)"},
    "gemma3n": {"ubatch.token": "the sqrt(n_embd) scale of token input, guarded to the first stage"},
    "gemma4": {"ubatch.token": "the sqrt(n_embd) scale of token input, guarded to the first stage",
               "n_layer": "a comment on the per-layer inputs' shape (every stage computes all n_layer of them)"},
    # Nemotron-H (and its MoE variant, which builds the same graph): n_layer indexes the input of
    # the layer after the last (cparams.embeddings_layer_inp / res->t_layer_inp), which only the
    # last stage reaches (an earlier one returns at the boundary), and il_end == n_layer there.
    "nemotron_h": {"n_layer": "the final layer-input extraction, reached on the last stage only"},
    "nemotron_h_moe": {"n_layer": "the final layer-input extraction, reached on the last stage only"},
    "deepseek4": {"n_layer": "the final layer-input extraction (embeddings_layer_inp[n_layer]), reached on the "
                             "last stage only"},
    "nanbeige": {"n_layer": "the block count where the file does not loop its blocks (n_layer_phys 0)"},
    "minimax-01": {"n_layer": "the lightning-attention slope scale divides the global layer index by the "
                              "model's depth (n_layer stays the whole model's on every stage)"},
}

#: Generic rule for a value residual (RWKV-7's v_first: every layer mixes in the first layer's
#: value projection): the boundary is wide (patch 0012), each row carries v_first after the hidden
#: state, and a stage past the first reads it from its input rows before the layer loop (the first
#: stage's build_stage_sideband_in is nullptr: layer 0 sets it, as unsplit).
VALUE_RESIDUAL = "ggml_tensor * v_first = nullptr;"
VALUE_RESIDUAL_IN = "v_first = build_stage_sideband_in(1); // skippy: a later stage reads v_first beside the hidden state"

#: The graph's input embedding: of the batch's tokens, or of ids the graph computes from them (Granite
#: Switch embeds adapter-substituted ids, ``ggml_get_rows(ctx0, model.tok_embd, sub_tokens)``).
INPUT_EMBD = re.compile(r"build_inp_embd\(model\.tok_embd\)|ggml_get_rows\(ctx0, model\.tok_embd, \w+\)")
#: Generic rule for an input embedding of computed ids: the lookup is the first stage's, and a later
#: stage takes the hidden state as its input (its input transforms are then guarded as any others).
EMBD_ROWS = re.compile(r"= (ggml_get_rows\(ctx0, model\.tok_embd, \w+\));")
EMBD_ROWS_NEW = r"= il_start == 0 ? \1 : build_inp_embd(nullptr); // skippy: a later stage takes the hidden state"

#: Generic rule for a router layer (Granite Switch: an attention of its own at KV slot
#: ``hparams.router_layer``, past the last layer, over signals its graph input computes from the
#: token ids; its output picks each token's LoRA adapter on every layer): every stage runs the router
#: itself from the token ids it receives (TOKEN_IDS, patch 0010), on KV cells of its own (patch 0014
#: keeps the router layer's cells on every stage), exactly as the unsplit model runs it.
ROUTER = "hparams.router_layer"

LOOP = "for (int il = 0; il < n_layer; ++il)"
LOOP_NEW = "for (int il = il_start; il < il_end; ++il)"
LAST = "il == n_layer - 1"
LAST_NEW = "il == il_end - 1"


@dataclass
class Arch:
    enum: str
    name: str
    cls: str | None = None
    files: list[str] = field(default_factory=list)
    graph_owner: str = ""   # the class whose graph this one reuses (`using graph = X::graph`)
    status: str = ""        # "splits" or "refused"
    token_input: int = 0    # TOKEN_IDS / TOKEN_EMBEDDINGS: what a later stage reads beside the hidden state
    stage_rows: int = 1     # n_embd-wide parts per row at a boundary (patch 0012; 1: the hidden state;
                            # HYPER_ROWS: the model's hyper-connection count)
    reason: str = ""        # why refused (or how it splits)
    new_text: dict[str, str] = field(default_factory=dict)


class TransformError(Exception):
    """The rules do not apply to this graph; the message says which one."""


class InherentRefusal(TransformError):
    """The graph is understood, and the model itself cannot split; the message is the reason."""


class EmbeddingSkip(InherentRefusal):
    """The layers read the input embedding: inherent unless every stage embeds the token ids
    (``transform`` then applies the SKIP_EMBD rule)."""


# --- reading the tree ---------------------------------------------------------------------------


def read_archs(src: Path) -> list[Arch]:
    text = (src / "src" / "llama-arch.cpp").read_text()
    block = text[text.index("LLM_ARCH_NAMES"):]
    block = block[: block.index("};")]
    archs = [Arch(enum=m.group(1), name=m.group(2)) for m in re.finditer(r"\{\s*(LLM_ARCH_\w+),\s*\"([^\"]+)\"", block)]
    archs = [a for a in archs if a.enum != "LLM_ARCH_UNKNOWN"]
    model_cpp = (src / "src" / "llama-model.cpp").read_text()
    # the factory: runs of `case LLM_ARCH_X:` followed by `return new llama_model_Y(params);`
    factory: dict[str, str] = {}
    pending: list[str] = []
    for line in model_cpp.splitlines():
        case = re.match(r"\s*case (LLM_ARCH_\w+):", line)
        if case:
            pending.append(case.group(1))
            continue
        ret = re.match(r"\s*return new (llama_model_\w+)\(", line)
        if ret and pending:
            for enum in pending:
                factory.setdefault(enum, ret.group(1))
        if line.strip() and not case:
            pending = []
    sources = {p.name: p.read_text() for p in sorted((src / "src" / "models").glob("*.cpp"))}
    for arch in archs:
        arch.cls = factory.get(arch.enum)
        if arch.cls:
            arch.files = [name for name, body in sources.items() if re.search(rf"\b{arch.cls}::", body)]
            arch.graph_owner = graph_alias(src, arch.cls)
            parent = base_class(src, arch.cls)
            if not arch.files and parent not in ("", "llama_model_base"):
                # a subclass that overrides nothing (qwen3tts): its loader and graph are the parent's
                arch.graph_owner = parent
            if arch.graph_owner:
                # the graph is the owner's: its constructor lives in the owner's file(s)
                arch.files += [name for name, body in sources.items()
                               if re.search(rf"\b{arch.graph_owner}::graph", body) and name not in arch.files]
    return archs


def no_kv_archs(src: Path) -> set[str]:
    """Architectures whose create_memory returns no KV cache (encoders, embedding models)."""
    text = (src / "src" / "llama-model.cpp").read_text()
    start = text.index("llama_memory_i * llama_model::create_memory")
    body = text[start:]
    head = body[: body.index("res = nullptr;")]
    return set(re.findall(r"case (LLM_ARCH_\w+):", head))


def graph_alias(src: Path, cls: str) -> str:
    """The class whose graph ``cls`` reuses (``using graph = llama_model_X::graph...;``), or ""."""
    header = (src / "src" / "models" / "models.h").read_text()
    m = re.search(rf"struct {cls}\s*:[^{{]*\{{", header)
    if m is None:
        return ""
    body = header[m.end():_match_brace(header, m.end() - 1)]
    alias = re.search(r"using graph = (llama_model_\w+)::graph\b", body)
    return alias.group(1) if alias else ""


def base_class(src: Path, cls: str) -> str:
    header = (src / "src" / "models" / "models.h").read_text()
    m = re.search(rf"struct {cls}\s*:\s*public\s+(\w+)", header)
    return m.group(1) if m else ""


# --- the transform ------------------------------------------------------------------------------


def _match_brace(text: str, open_at: int) -> int:
    """Index of the brace closing the one at ``open_at`` (comments and strings skipped)."""
    depth = 0
    i = open_at
    n = len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            i = text.index("\n", i)
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i
        i += 1
    raise TransformError("unbalanced braces")


def main_graph_span(text: str) -> tuple[int, int]:
    """The body of the graph constructor that builds the token-input graph."""
    found = INPUT_EMBD.search(text)
    if found is None:
        raise TransformError("no build_inp_embd(model.tok_embd) (not a token-input decoder graph)")
    embd = found.start()
    ctor = None
    for m in re.finditer(r"::graph(<\w+>)?::graph\([^)]*\)[^{]*\{", text):
        if m.start() < embd:
            ctor = m
    if ctor is None:
        raise TransformError("no graph constructor before the input embedding")
    end = _match_brace(text, ctor.end() - 1)
    if not ctor.end() < embd < end:
        raise TransformError("the input embedding is not built in a graph constructor")
    if len(INPUT_EMBD.findall(text, ctor.end(), end)) != 1:
        raise TransformError("more than one input embedding in the graph")
    return ctor.end(), end


_IDENT = re.compile(r"\b[A-Za-z_]\w*\b")
_ASSIGNED = re.compile(r"\b(\w+)\s*=(?!=)")
_DECLARED = re.compile(r"^(?:const\s+)?(?:auto|[\w:]+(?:<[^>]*>)?)\s*[*&]?\s*(\w+)\s*=(?!=)")
#: Statements that only observe a tensor (name it for the callback, expand the graph with it).
_CB = re.compile(r"(?:cb\(|ggml_build_forward_expand\(\s*gf\s*,)\s*(\w+)\s*[,)]")


def _code(text: str) -> str:
    """``text`` without comments and string literals (for finding identifiers)."""
    text = re.sub(r"//[^\n]*|/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r'"(?:\\.|[^"\\])*"', '""', text).strip()


def _statements(text: str) -> list[tuple[int, int]]:
    """Spans of the top-level statements of a block's text; a span starts where the previous one
    ended (its leading blank lines and comments included) and ends after its ``;`` or ``}``."""
    spans: list[tuple[int, int]] = []
    start = i = depth = 0
    n = len(text)
    while i < n:
        if text.startswith("//", i):
            i = text.index("\n", i)
            continue
        if text.startswith("/*", i):
            i = text.index("*/", i) + 2
            continue
        c = text[i]
        if c == '"':
            i += 1
            while text[i] != '"':
                i += 2 if text[i] == "\\" else 1
        elif c in "({[":
            depth += 1
        elif c in ")}]":
            depth -= 1
            if depth < 0:
                raise TransformError("unbalanced brackets before the layer loop")
            compound = re.match(r"(if|for|while|switch)\b|\{", _code(text[start:i]))
            if c == "}" and depth == 0 and compound and not re.match(r"\s*else\b", text[i + 1:]):
                spans.append((start, i + 1))
                start = i + 1
        elif c == ";" and depth == 0:
            spans.append((start, i + 1))
            start = i + 1
        i += 1
    if _code(text[start:]):
        raise TransformError("an unterminated statement before the layer loop")
    return spans


def carried_variable(prelude: str, body: str, loop_body: str) -> str:
    """The variable that carries the hidden state from layer to layer: ``inpL`` where the loop
    ends by assigning it, or ``cur`` where the input embedding goes into ``cur`` and the graph
    has no ``inpL`` at all (each layer then reads and rewrites ``cur``: lfm2)."""
    if ends_assigning(loop_body, "inpL"):
        return "inpL"
    if re.search(r"\bcur = build_inp_embd\(model\.tok_embd\);", prelude) and not re.search(r"\binpL\b", body):
        return "cur"
    streams = HYPER_INIT.findall(re.sub(r"//[^\n]*", " ", prelude))
    if len(streams) == 1 and HYPER.search(_code(body)) and ends_assigning(loop_body, streams[0]):
        return streams[0]
    raise TransformError("the layer loop does not end by assigning `inpL` on every path (nor carries `cur` "
                         "from the input embedding, nor the hyper-connection streams named hc_init)")


def ends_assigning(block: str, var: str) -> bool:
    """Whether every path through ``block`` (a brace block's inner text) ends by assigning
    ``var``: its last statement other than observers (``cb``, ``ggml_build_forward_expand``)
    assigns it, or is an if / else if / else whose every branch does."""
    spans = _statements(block)
    codes = [_code(block[a:b]) for a, b in spans]
    while codes and _CB.match(codes[-1]):
        codes.pop()
        spans.pop()
    if not codes:
        return False
    last = codes[-1]
    if re.match(rf"{var}\s*=(?!=)", last):
        return True
    if not last.startswith("if"):
        return False
    text = block[spans[-1][0]:spans[-1][1]]
    blocks: list[tuple[int, int]] = []
    while (open_at := _top_level_brace(text, blocks[-1][1] + 1 if blocks else 0)) >= 0:
        blocks.append((open_at, _match_brace(text, open_at)))
    if not all(ends_assigning(text[a + 1:b], var) for a, b in blocks):
        return False
    # exhaustive (the last branch is a plain `else`), or else the statements before it end by
    # assigning `var` (a conditional re-assignment after it: Nanbeige's norm between loops)
    if len(blocks) >= 2 and _code(text[blocks[-2][1] + 1:blocks[-1][0]]) == "else":
        return True
    return ends_assigning(block[:spans[-1][0]], var)


def _top_level_brace(text: str, start: int) -> int:
    """The first ``{`` at or after ``start`` outside parentheses (-1 when none)."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
        elif text[i] == "{" and depth == 0:
            return i
    return -1


def guard_input_transforms(body: str, loop_at: int, reads_reviewed: bool = False,
                           readers: frozenset[str] = frozenset()) -> tuple[str, list[str]]:
    """Wrap the input transforms between the embedding and the layer loop in ``STAGE_FIRST``.

    A transform is a statement that assigns the embedding's variable; a statement right before
    one whose results only transforms read (a position embedding looked up) joins it, and so do
    the calls observing a transform's result (``cb``, ``ggml_build_forward_expand``).  Each run
    of consecutive transforms becomes one guarded block (nothing is reordered).  A name declared
    in a run and read after it is refused; another read of the embedding before the loop (which
    a later stage would see as hidden state) is an inherent refusal when the layers read its
    result, else a finding, unless ``reads_reviewed`` (REVIEWED's "input read": a graph reviewed
    to give a later stage what it reads).  ``readers`` names variables a reviewed edit
    lets read the embedding (Gemma 4's per-layer projection).  Returns the new body and the lint
    findings.
    """
    embd_at = body.index("build_inp_embd(")
    embd_end = body.index(";", embd_at) + 1
    if re.match(r"[ \t]*//[^\n]*", body[embd_end:]):  # a trailing comment stays on its line
        embd_end = body.index("\n", embd_end)
    line_start = body.rfind("\n", 0, embd_at) + 1
    declared = _ASSIGNED.search(body, line_start, embd_at)
    if declared is None:
        raise TransformError("the input embedding is not assigned to a variable")
    var = declared.group(1)
    region = body[embd_end:loop_at]
    spans = _statements(region)
    codes = [_code(region[a:b]) for a, b in spans]
    cbs = [_CB.match(code) for code in codes]
    defs = [set() if cbs[i] else set(_ASSIGNED.findall(code)) for i, code in enumerate(codes)]
    uses = [set(_IDENT.findall(code)) for code in codes]
    later_uses = set(_IDENT.findall(_code(body[loop_at:])))
    guarded = {i for i in range(len(spans)) if var in defs[i]}

    def feeds_guarded(i: int) -> bool:
        # statement i only computes what the transform right after it (cb calls aside) reads
        if not defs[i] or i in guarded:
            return False
        k = i + 1
        while k < len(spans) and cbs[k] and cbs[k].group(1) in defs[i]:
            k += 1
        if k not in guarded or defs[i] & later_uses:
            return False
        readers = {j for j in range(i + 1, len(spans)) if defs[i] & uses[j] and not (cbs[j] and j > i)}
        return bool(readers) and readers <= guarded

    def names_guarded(i: int) -> bool:
        # a cb call whose tensor was last assigned by a guarded statement
        if not cbs[i] or i in guarded:
            return False
        name = cbs[i].group(1)
        writers = [j for j in range(i) if name in defs[j]]
        return bool(writers) and writers[-1] in guarded

    changed = True
    while changed:
        more = {i for i in range(len(spans)) if feeds_guarded(i) or names_guarded(i)}
        changed = bool(more - guarded)
        guarded |= more
    runs: list[list[int]] = []
    for i in sorted(guarded):
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    findings: list[str] = []
    for i in range(len(spans)):
        if i not in guarded and not cbs[i] and var in uses[i] and not reads_reviewed:
            if defs[i] and defs[i] <= readers:
                continue
            if defs[i] & later_uses:
                raise EmbeddingSkip(
                    "input-embedding skip: the layers read the input embedding (kept as "
                    f"`{'`, `'.join(sorted(defs[i] & later_uses))}`), which a later stage does not have")
            findings.append(f"reads the input embedding `{var}` before the layer loop (a later stage has hidden state there)")
    out: list[str] = []
    pos = 0
    for run in runs:
        inside = set(range(run[0], run[-1] + 1))
        for i in run:
            name = _DECLARED.match(codes[i])
            if name and (name.group(1) in later_uses
                         or any(name.group(1) in uses[j] for j in range(len(spans)) if j not in inside)):
                raise TransformError(f"`{name.group(1)}`, declared by an input transform, is read after it")
        # blank lines (and the comment ending the statement before) stay outside the block
        lead = re.match(r"[ \t]*(?://[^\n]*)?\s*\n", region[spans[run[0]][0]:])
        first = spans[run[0]][0] + (lead.end() if lead else 0)
        last = spans[run[-1]][1]
        indent = re.match(r"[ \t]*", region[first:]).group(0)
        block = region[first:last]
        block = "\n".join(("    " + line if line.strip() else line) for line in block.split("\n"))
        out.append(region[pos:first] + f"{indent}{STAGE_FIRST}\n" + block + f"\n{indent}}}")
        pos = last
    out.append(region[pos:])
    return body[:embd_end] + "".join(out) + body[loop_at:], findings


def transform(arch: Arch, text: str, owner: str = "") -> tuple[str, list[str]]:
    """Apply the rules to one model file; returns the new text and the lint findings.

    ``owner`` names the architecture whose file (and graph) it is, when ``arch`` reuses
    another's graph: the reviewed edits and lint findings of the file are the owner's.
    """
    name = owner or arch.name
    start, end = main_graph_span(text)
    body = text[start:end]
    if body.count(LOOP) != 1:
        raise TransformError(f"expected one `{LOOP}`, found {body.count(LOOP)}")
    loop_at = body.index(LOOP)
    loop_open = body.index("{", loop_at)
    loop_close = _match_brace(body, loop_open)
    loop_uses = set(_IDENT.findall(_code(body[loop_open:loop_close])))
    embd_end = body.index(";", INPUT_EMBD.search(body).start()) + 1
    arch.token_input = 0
    modality: list[str] = []  # statements choosing the layers' weights by the input modality
    for a, b in _statements(body[embd_end:loop_at]):
        code = _code(body[embd_end + a:embd_end + b])
        chosen = set(_ASSIGNED.findall(code)) - {"inpL"}
        if "ubatch.token" in code and chosen & loop_uses:
            # the layers pick their weights by whether the batch holds tokens: every stage receives
            # the token ids of a text batch (patch 0010), so a text batch is text on every stage
            arch.token_input = TOKEN_IDS
            modality.append(code)
    if ROUTER in _code(body[:loop_at]):
        arch.token_input = TOKEN_IDS  # the router reads the token ids on every stage
    if NGRAM_INPUT in _code(body[:loop_at]):
        arch.token_input = TOKEN_IDS  # the n-gram input hashes the token ids on every stage
    # layers that read the token ids (TOKEN_READS) or test the modality by the input embeddings
    # (MEDIA_TEST): every later stage receives the ids (patch 0010), and the layers read them
    loop_text = body[loop_open:loop_close]
    for old, new in (*TOKEN_READS, MEDIA_TEST):
        if old not in loop_text:
            continue
        if body.count(old) != loop_text.count(old):
            raise TransformError(f"`{old}` outside the layer loop")
        loop_text = loop_text.replace(old, new)
        arch.token_input = arch.token_input or TOKEN_IDS
    body = body[:loop_open] + loop_text + body[loop_close:]
    loop_close = _match_brace(body, loop_open)
    carried = carried_variable(body[:loop_at], body, body[loop_open + 1:loop_close])
    if "build_stage_boundary" in body:
        raise TransformError("already transformed")
    if (body.count(LAST) < 1 and "inp_out_ids" in body and "build_inp_out_ids()" not in body[loop_close:]
            and "inp_out_ids" in _code(body[loop_open:loop_close])):
        # no selection in the loop: a graph without output ids computes every row on every layer
        # (CogVLM), or one that picks the output rows after the loop (Gemma 3n builds the ids
        # there, DeepSeek V4 before the loop; a stage that is not the last has none, patch 0001)
        raise TransformError(f"no `{LAST}` (output-row selection) in the layer loop")
    if body.count(LAST, loop_open, loop_close) != body.count(LAST):
        raise TransformError(f"`{LAST}` outside the layer loop")
    tail = body[loop_close:]
    if "model.output_norm" not in tail and "model.output" not in tail:
        raise TransformError("no output head after the layer loop")
    indent = re.search(r"\n([ \t]*)[^\n]*$", body[:loop_at]).group(1)
    sideband, publish, sideband_in = "", "build_stage_boundary", ""
    arch.stage_rows = 1
    if VALUE_RESIDUAL in body:
        if body.count(VALUE_RESIDUAL) != 1 or len(re.findall(r"\bv_first\b", _code(body))) != 2:
            raise TransformError("value residual: expected one `v_first` declared and passed to the time mix once")
        sideband, sideband_in, arch.stage_rows = ", {v_first}", f"{VALUE_RESIDUAL_IN}\n\n{indent}", 2
    elif STREAMS.search(_code(body)):
        if carried != "inpL":
            raise TransformError("parallel streams: the layers do not carry them in `inpL`")
        publish, sideband_in, arch.stage_rows = "build_stage_boundary_streams", f"{STREAMS_IN}\n\n{indent}", STREAMS_ROWS
    elif HYPER.search(_code(body)):
        publish, sideband_in, arch.stage_rows = (
            "build_stage_boundary_hc", HYPER_IN.format(var=carried) + f"\n\n{indent}", HYPER_ROWS)
    elif BANKED.search(_code(text)):  # the graph's own helpers push onto and read the bank
        publish, sideband, sideband_in, arch.stage_rows = (
            "build_stage_boundary_banked", ", resi_stack", BANKED_IN.format(var=carried) + f"\n\n{indent}", BANKED_ROWS)
    boundary = (
        f"\n{indent}// skippy: a stage that is not the last hands on the pre-norm hidden state\n"
        f"{indent}if ({publish}({carried}{sideband})) {{\n{indent}    return;\n{indent}}}"
    )
    new_body = (
        body[:loop_at] + LOOP_NEW + body[loop_at + len(LOOP):loop_close + 1] + boundary + body[loop_close + 1:]
    )
    new_body = new_body.replace(LAST, LAST_NEW)
    # a row selection that does not test for the output ids (a stage that is not the last has none)
    new_body = new_body.replace(f"if ({LAST_NEW}) {{", f"if ({LAST_NEW} && inp_out_ids) {{")
    guards = new_body.count(EMBD_GUARD[0])
    new_body = new_body.replace(EMBD_GUARD[0], EMBD_GUARD[1])
    per_layer = "project_per_layer_inputs(" in new_body
    slice_name = PER_LAYER_SLICE.search(new_body) if per_layer else None
    width_name = PER_LAYER_WIDTH.search(text) if per_layer else None
    if per_layer and (slice_name is None or width_name is None):
        raise TransformError("per-layer token embeddings: no per-layer slice of `inp_per_layer` or projection width")
    names = {"slice": slice_name.group(1), "width": width_name.group(1)} if slice_name and width_name else {}
    per_layer_edits = [(old.format(**names), new.format(**names), n) for old, new, n in PER_LAYER_EDITS] if per_layer else []
    per_layer_helper_edits = ([(old.format(**names), new.format(**names), n) for old, new, n in PER_LAYER_HELPER_EDITS]
                              if per_layer else [])
    for old, new, count in per_layer_edits:
        found = new_body.count(old)
        if found != count:
            raise TransformError(f"per-layer token embeddings: edit {old!r}: expected {count} match(es), found {found}")
        new_body = new_body.replace(old, new)
    ngram_edits: list[str] = []
    if NGRAM_INPUT in _code(new_body):
        # the n-gram table is a per-layer token embedding: the loader keeps it and the token
        # embeddings on every stage (patch 0006), so a later stage passes none to the input
        # embedding and takes its hidden state (the first of PER_LAYER_EDITS)
        old, new, count = PER_LAYER_EDITS[0]
        if new_body.count(old) != count:
            raise TransformError(f"n-gram input: edit {old!r}: expected {count} match(es), found {new_body.count(old)}")
        new_body = new_body.replace(old, new)
        ngram_edits.append(new)
    rows_edits: list[str] = []
    if "build_inp_embd(model.tok_embd)" not in body:  # EMBD_ROWS: an embedding of computed ids
        found = EMBD_ROWS.findall(new_body)
        if len(found) != 1:
            raise TransformError(f"input embedding of computed ids: expected one lookup, found {len(found)}")
        rows_edits = [EMBD_ROWS.sub(EMBD_ROWS_NEW, EMBD_ROWS.search(new_body).group(0))]
        new_body = EMBD_ROWS.sub(EMBD_ROWS_NEW, new_body)
    # the per-layer projection reads the embedding on the first stage only (PER_LAYER_EDITS)
    skip_edits: list[str] = []
    try:
        new_body, findings = guard_input_transforms(
            new_body, new_body.index(LOOP_NEW), "input read" in REVIEWED.get(name, {}),
            # (hyper-connections: the streams built from the embedding are the first stage's; a
            # later stage replaces them with its input rows, HYPER_IN)
            readers=(frozenset({"inp_per_layer"}) if per_layer else frozenset())
            | (frozenset({carried}) if arch.stage_rows == HYPER_ROWS else frozenset()))
    except EmbeddingSkip:
        if per_layer or len(SKIP_EMBD.findall(new_body)) != 1:
            raise
        # SKIP_EMBD: the transforms run on every stage, on the token embeddings it looks up itself
        new_body = SKIP_EMBD.sub(SKIP_EMBD_NEW, new_body)
        skip_edits = [SKIP_EMBD.sub(SKIP_EMBD_NEW, SKIP_EMBD.search(body).group(0)),
                      SKIP_HIDDEN.format(var=carried)]
        loop_at = new_body.index(LOOP_NEW)
        indent_loop = re.search(r"([ \t]*)$", new_body[:loop_at]).group(1)
        new_body = new_body[:loop_at] + skip_edits[1] + "\n\n" + indent_loop + new_body[loop_at:]
        findings = []
        arch.token_input = TOKEN_EMBEDDINGS
    if sideband_in:  # after the guarded input transforms: a later stage's own input
        new_body = new_body.replace(LOOP_NEW, sideband_in + LOOP_NEW, 1)
    for old, new, count in ARCH_EDITS.get(name, []):
        found = new_body.count(old)
        if found != count:
            raise TransformError(f"edit {old!r}: expected {count} match(es), found {found}")
        new_body = new_body.replace(old, new)
    head = new_body.index("build_stage_boundary")
    if new_body.count(TIED_HEAD[0], head) == 1 and not re.search(r"\boutput\s*=\s*create_tensor", text):
        # the tied head reads the token embeddings, which only the first stage loads: the last
        # stage loads them as model.output (the loader's duplicated tied head) and the head reads that
        new_body = new_body[:head] + new_body[head:].replace(TIED_HEAD[0], TIED_HEAD[1])
        if text.count(TIED_HEAD_LOAD[0]) != 1:
            raise TransformError("the head reads model.tok_embd and the loader's output norm is not created once")
        text = text.replace(TIED_HEAD_LOAD[0], TIED_HEAD_LOAD[1])
        start, end = main_graph_span(text)
    if LINT["tok_embd"].search(_code(new_body[head:])):
        raise TransformError("the head reads model.tok_embd, which only the first stage loads (not "
                             "duplicated as model.output)")
    rest = text[end:]  # the per-layer helpers live after the graph constructor
    for old, new, count in per_layer_helper_edits:
        found = rest.count(old)
        if found != count:
            raise TransformError(f"per-layer token embeddings: helper edit {old!r}: expected {count} match(es), found {found}")
        rest = rest.replace(old, new)
    # lint what is left in the graph body
    scan = new_body
    for new in skip_edits + rows_edits + ngram_edits:
        scan = scan.replace(new, "")
    scan = scan.replace(LOOP_NEW, "").replace(LAST_NEW, "").replace(EMBD_GUARD[1], "")
    scan = scan.replace("build_inp_embd(model.tok_embd)", "")
    for _, new, _ in per_layer_edits:
        scan = scan.replace(new, "")
    scan = _code(scan)  # code only: comments may name anything
    for code in modality:  # the modality rule's statements (a text batch is text on every stage)
        scan = scan.replace(code, "")
    scan = scan.replace(MEDIA_TEST[1], "")  # the modality test rewritten to read the token ids
    for label, pattern in LINT.items():
        if pattern.search(scan) and label not in REVIEWED.get(name, {}):
            findings.append(f"uses {label} outside the layer loop")
    if guards and name not in {"glm4", "glm4moe"} and "ubatch.embd" not in REVIEWED.get(name, {}):
        findings.append("guards on embedding input")
    head, tail = text[:start], rest
    for old, new, count in FILE_EDITS.get(arch.name, []):
        found = head.count(old) + tail.count(old)
        if found != count:
            raise TransformError(f"file edit {old!r}: expected {count} match(es) outside the graph, found {found}")
        head, tail = head.replace(old, new), tail.replace(old, new)
    head, tail = (LOADER_EITHER.sub(LOADER_EITHER_NEW, part) for part in (head, tail))
    return head + new_body + tail, findings


# --- classification -----------------------------------------------------------------------------

#: Model bases whose layers keep recurrent state (conv / SSM / WKV / delta-net) instead of, or
#: beside, KV cells.  Patch 0005 gives a layer range the state of its own layers only, so such a
#: graph splits by the same rules as an attention one; `is_recurrent` only labels them.
RECURRENT_BASES = {"llama_model_mamba_base", "llama_model_rwkv6_base", "llama_model_rwkv7_base",
                   "llama_model_delta_net_base"}


#: A draft head's own graph reads its target model: the target context, its layers or hidden size.
DRAFT_HEAD = re.compile(r"cparams\.ctx_other|ml\.get_\w+\(LLM_KV_TARGET_")


def is_recurrent(base: str, joined: str) -> bool:
    return base in RECURRENT_BASES or bool(re.search(r"build_rs\(|build_inp_rs\(|ssm_conv|time_mix", joined))


def classify(src: Path, archs: list[Arch]) -> None:
    no_kv = no_kv_archs(src)
    models = src / "src" / "models"
    owners: dict[str, str] = {}
    for arch in archs:
        if arch.cls:
            owners.setdefault(arch.cls, arch.name)
    for arch in archs:
        arch.status = "refused"
        if arch.cls is None:
            arch.reason = "not a text model llama.cpp can run (no model class)"
            continue
        if arch.enum == "LLM_ARCH_CLIP":
            arch.reason = "not a text model: a vision encoder llama.cpp only quantizes"
            continue
        texts = {name: (models / name).read_text() for name in arch.files}
        joined = "\n".join(texts.values())
        base = base_class(src, arch.cls)
        if arch.enum in no_kv:
            arch.reason = "encoder or embedding model: no KV cache, no causal generation"
        elif arch.name.startswith("t5") or "build_inp_cross_embd" in joined or "dec_start" in joined:
            arch.reason = "encoder-decoder: the decoder attends to the encoder output"
        elif DRAFT_HEAD.search(texts.get(f"{arch.name}.cpp", "")):
            arch.reason = ("draft head: it runs only beside its target model, whose hidden states or "
                           "embeddings it reads, never as a model of its own")
        elif arch.name not in SPLIT and ("LLM_KV_HYPER_CONNECTION_COUNT" in joined
                                         or re.search(r"\bbuild_hc_\w+\(|\bhc_mult\b", joined)):
            arch.reason = ("hyper-connections: layers hand on hc_mult parallel residual streams "
                           "(hc_mult x n_embd per token), which the boundary-rows extension (docs/protocol.md "
                           "§12) and patch 0013 carry across a cut")
            arch.reason += "; this family has no synthetic writer and exactness cases yet"
        elif re.search(r"\blayers\[[^\]]+\]\s*=\s*layers\[", joined) and "LLM_KV_NUM_LOOPS" not in joined:
            # (num_loops: slot il runs block il % the file's blocks, and a stage loads the blocks its
            # slots run (patch 0011); the graph is then a loop over slots like any other)
            states = sorted(set(re.findall(r"\b(\w+) = build_stack\(", joined)))
            arch.reason = ("layers reused in depth in a hierarchical recurrence: the graph runs stacks of "
                           "shared blocks in cycles, not a loop over layers, and carries "
                           + (f"{len(states)} states (`{'`, `'.join(states)}`)" if states else "several states")
                           + " from stack to stack, wider than the n_embd-wide hidden state of a frame")
        elif arch.graph_owner and re.search(r"\bgraph<true>", "".join(
                texts[name] for name in arch.files if not re.search(rf"\b{arch.graph_owner}::graph", texts[name])
        )) and "template <bool embed>" in joined:
            arch.reason = ("embedding model: it builds the shared graph's embedding variant (attention without "
                           "a KV cache, no LM head), no causal generation")
        elif "attn_res_block_size" in joined and arch.name not in SPLIT:
            arch.reason = ("cross-layer residual attention: layers mix the banked inputs of every earlier "
                           "block (one per attn_res_block_size layers), so a cut at layer L would have to hand "
                           "on L / attn_res_block_size banked rows beside the hidden state: a width that grows "
                           "with the cut's depth, which no stage protocol flag announces")
        else:
            main = [name for name, body in texts.items() if INPUT_EMBD.search(body)]
            if len(main) != 1:
                arch.reason = "graph does not follow the standard layer loop (no single token-input graph)"
                continue
            try:
                new_text, findings = transform(arch, texts[main[0]], owners.get(arch.graph_owner, ""))
            except InherentRefusal as exc:
                arch.reason = str(exc)
                continue
            except TransformError as exc:
                if "per_layer_tok_embd" in joined and "project_per_layer_inputs(" not in joined:
                    arch.reason = "per-layer token embeddings built otherwise than Gemma 4's (the rule does not apply)"
                else:
                    arch.reason = f"graph does not follow the standard layer loop ({exc})"
                continue
            if findings:
                arch.reason = "needs review: the graph " + "; ".join(findings)
                continue
            if arch.name in SPLIT:
                arch.status = "splits"
                arch.reason = "tested: bitwise-exact splits on synthetic models"
                arch.new_text = {f"src/models/{main[0]}": new_text}
            elif arch.name in INHERENT:
                arch.reason = INHERENT[arch.name]
            else:
                arch.reason = ("not validated: the layer-loop rules apply, but no synthetic writer and "
                               "exactness test cover it yet")
    both = set(SPLIT) & set(INHERENT)
    if both:
        raise SystemExit(f"architectures both split and refused as inherent: {sorted(both)}")
    stale = set(INHERENT) - {a.name for a in archs if a.reason == INHERENT.get(a.name)}
    if stale:
        raise SystemExit(f"INHERENT names architectures the rules do not reach: {sorted(stale)}")
    missing = set(SPLIT) - {a.name for a in archs if a.status == "splits"}
    if missing:
        detail = "; ".join(f"{a.name}: {a.reason}" for a in archs if a.name in missing)
        raise SystemExit(f"architectures in SPLIT do not transform: {sorted(missing)} ({detail})")


# --- outputs ------------------------------------------------------------------------------------


def c_string(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def render_inc(archs: list[Arch]) -> str:
    lines = [
        "// generated by native/layer_range_gen.py from the pinned llama.cpp tree: do not edit",
        "// skippy: whether an architecture accepts a partial layer range; nullptr when it does,",
        "// else the reason it is refused",
        "static const char * llm_arch_stage_refusal(llm_arch arch) {",
        "    switch (arch) {",
    ]
    for arch in archs:
        if arch.status == "splits":
            lines.append(f"        case {arch.enum}: return nullptr;")
    for arch in archs:
        if arch.status != "splits":
            lines.append(f"        case {arch.enum}: return {c_string(arch.reason)};")
    lines += [
        "        default: return \"unknown architecture\";",
        "    }",
        "}",
        "",
        "// skippy: what a stage past the first reads beside the hidden state (patch 0010): 1 the token",
        "// ids, 2 the ids and the token embeddings; 0 nothing (per-layer token embeddings: hparams)",
        "static int32_t llm_arch_stage_token_input(llm_arch arch) {",
        "    switch (arch) {",
    ]
    for arch in archs:
        if arch.status == "splits" and arch.token_input:
            lines.append(f"        case {arch.enum}: return {arch.token_input};")
    lines += [
        "        default: return 0;",
        "    }",
        "}",
        "",
        "// skippy: n_embd-wide parts per row at a stage boundary (patch 0012): 1, the hidden state,",
        "// or more where the architecture hands on a sideband beside it",
        "// (hyper-connections: the model's hc_mult parallel residual streams), at the boundary before",
        "// layer il (banked layer inputs: the hidden state and the rows banked before il, patch 0013)",
        "static uint32_t llm_arch_stage_rows(llm_arch arch, const llama_hparams & hparams, uint32_t il) {",
        "    switch (arch) {",
    ]
    for arch in archs:
        if arch.status == "splits" and arch.stage_rows != 1:
            rows = {HYPER_ROWS: "hparams.dsv4_hc_mult",
                    BANKED_ROWS: "hparams.attn_res_block_size > 0 ? 1 + (il + hparams.attn_res_block_size - 1) "
                                 "/ hparams.attn_res_block_size : 1"}.get(arch.stage_rows, arch.stage_rows)
            lines.append(f"        case {arch.enum}: return {rows};")
    lines += [
        "        default: GGML_UNUSED(il); return 1;",
        "    }",
        "}",
        "",
    ]
    return "\n".join(lines)


def unified(path: str, old: str | None, new: str) -> str:
    old_lines = [] if old is None else old.splitlines(keepends=True)
    new_lines = new.splitlines(keepends=True)
    diff = difflib.unified_diff(
        old_lines, new_lines,
        fromfile="/dev/null" if old is None else f"a/{path}", tofile=f"b/{path}", n=3,
    )
    text = "".join(diff)
    header = f"diff --git a/{path} b/{path}\n"
    if old is None:
        header += "new file mode 100644\n"
    return header + text


def render_patch(src: Path, archs: list[Arch]) -> str:
    parts = [
        "skippy layer ranges, per architecture (generated by native/layer_range_gen.py: do not edit)\n\n"
        "Applies on top of 0001-layer-range-execution.patch: the layer loop of each split\n"
        "architecture's graph runs [il_start, il_end), the output rows are selected on the range's\n"
        "last layer, and a stage that is not the last returns its pre-norm hidden state after the\n"
        "loop.  src/llama-stage-archs.inc tells the loader which architectures accept a range.\n\n"
    ]
    # a graph several architectures share (``using graph = ...``) is one file: edited once
    files: dict[str, str] = {}
    for arch in (a for a in archs if a.status == "splits"):
        for path, new_text in arch.new_text.items():
            if files.setdefault(path, new_text) != new_text:
                raise SystemExit(f"{path}: the architectures sharing it edit it differently")
    for path, new_text in sorted(files.items()):
        parts.append(unified(path, (src / path).read_text(), new_text))
    parts.append(unified(INC_NAME, None, render_inc(archs)))
    return "".join(parts)


def render_py(archs: list[Arch]) -> str:
    lines = [
        "# Generated by native/layer_range_gen.py from the pinned llama.cpp tree: do not edit.",
        "#",
        "# Strategy: the same table the patched loader compiles in (src/llama-stage-archs.inc), so a",
        "# partial layer range of a refused architecture is refused before loading, with the reason.",
        "from __future__ import annotations",
        "",
        "from typing import Final",
        "",
        "#: Architectures whose layer ranges split exactly (tested).",
        "SPLIT_ARCHITECTURES: Final = frozenset({",
    ]
    for arch in archs:
        if arch.status == "splits":
            lines.append(f"    {arch.name!r},")
    lines += ["})", "", "#: Split architectures whose later stages read the token ids beside the hidden state "
              "(patch 0010; Gemma 4's", "#: per-layer token embeddings are told by the file's hparams).",
              "STAGE_TOKEN_IDS: Final = frozenset({"]
    lines += [f"    {arch.name!r}," for arch in archs if arch.status == "splits" and arch.token_input]
    lines += ["})", "", "#: ... of which those whose later stages also load the token embeddings and embed the ids.",
              "STAGE_TOKEN_EMBEDDINGS: Final = frozenset({"]
    lines += [f"    {arch.name!r}," for arch in archs if arch.status == "splits" and arch.token_input == TOKEN_EMBEDDINGS]
    lines += ["})", "", "#: Every other architecture llama.cpp knows, with the reason it is refused.",
              "REFUSED: Final[dict[str, str]] = {"]
    for arch in archs:
        if arch.status != "splits":
            lines.append(f"    {arch.name!r}: {arch.reason!r},")
    lines += ["}", "", "#: Split architectures whose stage boundary rows hold more than the hidden state: the",
              "#: n_embd-wide parts per row (the hidden state first, then the sideband; patch 0012); 0: the",
              "#: model's hyper-connection count (``<arch>.hyper_connection.count``, one row per stream);",
              "#: -1: 1 + the layer inputs banked before the cut (``<arch>.attn_res.block_size``, patch 0013).",
              "STAGE_ROWS: Final[dict[str, int]] = {"]
    for arch in archs:
        if arch.status == "splits" and arch.stage_rows != 1:
            lines.append(f"    {arch.name!r}: {arch.stage_rows},")
    lines += ["}", ""]
    return "\n".join(lines)


def render_docs(archs: list[Arch]) -> str:
    n_split = sum(a.status == "splits" for a in archs)
    counts: dict[str, int] = {}
    for arch in archs:
        if arch.status != "splits":
            key = arch.reason.split(":")[0].split(" (")[0]
            counts[key] = counts.get(key, 0) + 1
    lines = [
        "# Architectures",
        "",
        "Generated by `python native/layer_range_gen.py` from the pinned llama.cpp tree "
        f"(llama-cpp-python {native_build.LLAMA_CPP_PYTHON_VERSION}); do not edit by hand.",
        "",
        "A partial layer range (`--layers START:END` short of the whole model) is accepted only for",
        "the architectures marked **splits**: their graphs are transformed by the generated patch",
        "`native/patches/0002-layer-range-architectures.patch` and the exactness suite proves the split",
        "bitwise equal to the unsplit model on synthetic weights.  Every other architecture still runs",
        "unsplit (one stage holding all layers); asking for a partial range gets the reason below.",
        "",
        "Two constructs split under conditions.  Per-layer token embeddings (Gemma 4): every stage",
        "receives the token ids beside the hidden state (the frame's token sideband) and computes the",
        "per-layer inputs of its own layers; a later stage refuses a batch without them.  Layers that",
        "reuse the KV cells of earlier ones (Gemma 4 with `shared_kv_layers`): a cut may not separate them",
        "from the layers they read, so `--layers`, `skippy plan` and `skippy up --stages N` keep to the",
        "legal cuts the file's hparams give (`skippy/runtime/cuts.py`), and a refused cut names the",
        "nearest legal ones.  Layers that read the token ids split the same way as per-layer token",
        "embeddings (patch 0010): CogVLM's pick text or vision-expert weights by whether the batch holds",
        "tokens, so every later stage receives the ids of a text batch; Talkie's add the normalised input",
        "embedding, so every stage embeds the ids itself (loading the token embeddings).  Granite",
        "Switch's layers apply the LoRA adapter a router picks from the token ids (an attention of its",
        "own at KV slot n_layer): every stage runs the router from the ids it receives, on KV cells of",
        "its own (patch 0014), and only the first embeds the adapter-substituted ids.",
        "",
        "A value residual (RWKV-7's `v_first`: every layer mixes in the first layer's values) crosses a",
        "cut as a sideband: each activation row holds the hidden state and then `v_first` (patch 0012),",
        "and the frame says so with the protocol's `RWKV7_V_FIRST_SIDEBAND` flag (twice the rows).",
        "Parallel residual streams (Gemma 3n's four AltUp streams) cross it the same way, flagged",
        "`GEMMA3N_ALTUP_SIDEBAND` (four times the rows); Gemma 3n also reads the token ids on every stage",
        "(per-layer token embeddings, as Gemma 4).  Hyper-connections (DeepSeek V4's `hc_mult` residual",
        "streams) cross it as `hc_mult` rows per token, a width v11 has no flag for: the frame announces",
        "it with skippy's boundary-rows extension (`docs/protocol.md` §12, patch 0013).  Kimi-K3's banked",
        "layer inputs (cross-layer residual attention) make the width depend on the cut: a cut at layer",
        "L hands on the hidden state and the ceil(L / attn_res_block_size) rows banked so far.",
        "",
        f"{len(archs)} architectures: {n_split} split; refused: "
        + ", ".join(f"{k.lower()} {v}" for k, v in sorted(counts.items(), key=lambda kv: -kv[1])) + ".",
        "",
        "| architecture | model source | status | why |",
        "|---|---|---|---|",
    ]
    for arch in sorted(archs, key=lambda a: (a.status != "splits", a.name)):
        files = ", ".join(f"`{f}`" for f in arch.files) or "-"
        lines.append(f"| `{arch.name}` | {files} | {arch.status} | {arch.reason} |")
    lines.append("")
    return "\n".join(lines)


def generate(src: Path) -> dict[Path, str]:
    archs = read_archs(src)
    classify(src, archs)
    return {
        PATCH_PATH: render_patch(src, archs),
        PY_TABLE_PATH: render_py(archs),
        DOCS_PATH: render_docs(archs),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail when a committed output differs")
    parser.add_argument("--source", type=Path, help="pristine llama.cpp tree (default: the pinned sdist's)")
    args = parser.parse_args(argv)
    src = args.source or native_build._pristine_source()
    outputs = generate(src)
    stale = []
    for path, text in outputs.items():
        current = path.read_text() if path.exists() else None
        if current == text:
            continue
        if args.check:
            stale.append(str(path.relative_to(ROOT)))
        else:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    if stale:
        print("stale generated files (run python native/layer_range_gen.py): " + ", ".join(stale), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
