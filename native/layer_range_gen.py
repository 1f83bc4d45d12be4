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
   (``inpL``, which every such loop ends by assigning) and stops building the graph.

A few architectures need one more reviewed edit (``ARCH_EDITS``): gemma2 scales its input by
sqrt(n_embd) unconditionally (only token input on the first stage may be scaled), and the glm4
families abort on embedding input (which every later stage receives).  Every edit must match an
exact number of times, and after editing, the main graph body is linted for the constructs that
would make a split wrong (another use of ``n_layer``, the token embeddings, the raw input
embeddings, the batch's token/embd pointers); each remaining use must be listed as reviewed in
``REVIEWED``.  Architectures whose graph the rules cannot transform, or whose model has a feature
that a layer range cannot carry (recurrent state, cross-layer KV sharing, per-layer token
embeddings, an encoder), are refused with that reason.

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
SPLIT += ()
#
#: Issue 25, linear attention (gated delta-net, KDA, lightning attention) and hybrids of it.
SPLIT += ()
#
#: Issue 25, RWKV and short-convolution families.
SPLIT += ()
#
#: Issue 26, dense families the layer-loop rules already covered (writers and exactness added).
SPLIT += ()
#
#: Issue 26, MoE and sparse-attention families the layer-loop rules already covered.
SPLIT += ()
#
#: Issue 26, families the grown rules cover (input transforms, loops written differently).
SPLIT += ()
#
#: Issue 26, per-layer token embeddings and cross-layer KV sharing.
SPLIT += ("gemma4",)

#: Extra literal edits per architecture name: (old, new, expected count).
ARCH_EDITS: dict[str, list[tuple[str, str, int]]] = {}

#: Generic edit: the gemma families' sqrt(n_embd) input scale belongs to token input only, so it
#: is applied once, on the first stage (a later stage's input is already scaled hidden state).
INPUT_SCALE = (
    "inpL = ggml_scale(ctx0, inpL, sqrtf(n_embd));",
    "inpL = ggml_scale(ctx0, inpL, ubatch.token ? sqrtf(n_embd) : 1.0f); // skippy: token input only",
)

#: Generic edit: a refusal of embedding input (multimodal guards) applies to the first stage only.
EMBD_GUARD = ("if (ubatch.embd && ", "if (il_start == 0 && ubatch.embd && ")  # skippy: later stages take embd

#: Generic rule for per-layer token embeddings (Gemma 4): a stage past the first takes the hidden
#: state as its main input and, beside it, the token ids (patch 0006 loads the per-layer tensors and
#: the token embeddings on every stage); the token input's sqrt(n_embd) scale stays on the first
#: stage, and a later stage projects its own scaled token embeddings into the per-layer inputs.
PER_LAYER_EDITS: list[tuple[str, str, int]] = [
    ("inpL = build_inp_embd(model.tok_embd);",
     "inpL = build_inp_embd(il_start == 0 ? model.tok_embd : nullptr); // skippy: later stages take hidden states",
     1),
    ("inpL = ggml_scale(ctx0, inpL, ubatch.token ? sqrtf(n_embd) : 1.0f);",
     "inpL = ggml_scale(ctx0, inpL, il_start == 0 && ubatch.token ? sqrtf(n_embd) : 1.0f); // skippy: token input only",
     1),
    ("inp_per_layer = project_per_layer_inputs(inpL, inp_per_layer);",
     "inp_per_layer = project_per_layer_inputs(il_start == 0 ? inpL : build_stage_tok_embd(model.tok_embd, sqrtf(n_embd)),"
     " inp_per_layer); // skippy: a later stage embeds the token ids itself",
     1),
    ("gemma4_view_2d_slice(ctx0, inp_per_layer, il)", "gemma4_view_2d_slice(ctx0, inp_per_layer, il - il_start)", 1),
]
#: ... and in the graph's helpers after it: the per-layer inputs are built for the stage's layers only
#: (build_stage_layer_slice, patch 0006: the stage's columns of the token table, rows of the projection).
PER_LAYER_HELPER_EDITS: list[tuple[str, str, int]] = [
    ("ggml_get_rows  (ctx0, model.per_layer_tok_embd, inp->tokens);",
     "ggml_get_rows  (ctx0, build_stage_layer_slice(model.per_layer_tok_embd, 0, n_embd_per_layer), inp->tokens);", 1),
    ("ggml_view_1d(ctx0, model.per_layer_tok_embd, embd_size, 0);",
     "ggml_view_1d(ctx0, build_stage_layer_slice(model.per_layer_tok_embd, 0, n_embd_per_layer), "
     "embd_size / n_layer * (il_end - il_start), 0); // skippy: the stage's layers", 1),
    ("ggml_mul_mat   (ctx0, model.per_layer_model_proj, inp_batch);",
     "ggml_mul_mat   (ctx0, build_stage_layer_slice(model.per_layer_model_proj, 1, n_embd_per_layer), inp_batch);", 1),
    ("inp_per_layer, n_embd_per_layer, n_layer,", "inp_per_layer, n_embd_per_layer, il_end - il_start,", 2),
    ("per_layer_proj, n_embd_per_layer, n_layer,", "per_layer_proj, n_embd_per_layer, il_end - il_start,", 1),
]

#: Constructs in a main graph body that need a human look, with the ones reviewed per architecture.
LINT = {
    "n_layer": re.compile(r"\bn_layer\b"),
    "tok_embd": re.compile(r"model\.tok_embd\b"),
    "t_inp_embd": re.compile(r"res->t_inp_embd\b"),
    "ubatch.token": re.compile(r"\bubatch\.token\b"),
    "ubatch.embd": re.compile(r"\bubatch\.embd\b"),
}
REVIEWED: dict[str, dict[str, str]] = {
    "gemma3": {"ubatch.token": "the sqrt(n_embd) scale is already applied to token input only",
               "input op": "the same scale"},
    "granite": {"t_inp_embd": "deepstack (vision) injection; the loader refuses a range when deepstack layers exist"},
    "glm4": {"ubatch.embd": "the multimodal guard, limited to the first stage"},
    "glm4moe": {"ubatch.embd": "the multimodal guard, limited to the first stage"},
    "gemma4": {"n_layer": "a comment on the per-layer inputs' shape (every stage computes all n_layer of them)"},
}

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
    status: str = ""        # "splits" or "refused"
    reason: str = ""        # why refused (or how it splits)
    new_text: dict[str, str] = field(default_factory=dict)


class TransformError(Exception):
    """The rules do not apply to this graph; the message says which one."""


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
    return archs


def no_kv_archs(src: Path) -> set[str]:
    """Architectures whose create_memory returns no KV cache (encoders, embedding models)."""
    text = (src / "src" / "llama-model.cpp").read_text()
    start = text.index("llama_memory_i * llama_model::create_memory")
    body = text[start:]
    head = body[: body.index("res = nullptr;")]
    return set(re.findall(r"case (LLM_ARCH_\w+):", head))


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
    embd = text.find("build_inp_embd(model.tok_embd)")
    if embd < 0:
        raise TransformError("no build_inp_embd(model.tok_embd) (not a token-input decoder graph)")
    ctor = None
    for m in re.finditer(r"::graph(<\w+>)?::graph\([^)]*\)[^{]*\{", text):
        if m.start() < embd:
            ctor = m
    if ctor is None:
        raise TransformError("no graph constructor before the input embedding")
    end = _match_brace(text, ctor.end() - 1)
    if not ctor.end() < embd < end:
        raise TransformError("the input embedding is not built in a graph constructor")
    if text.count("build_inp_embd(model.tok_embd)", ctor.end(), end) != 1:
        raise TransformError("more than one input embedding in the graph")
    return ctor.end(), end


def transform(arch: Arch, text: str) -> tuple[str, list[str]]:
    """Apply the rules to one model file; returns the new text and the lint findings."""
    start, end = main_graph_span(text)
    body = text[start:end]
    if body.count(LOOP) != 1:
        raise TransformError(f"expected one `{LOOP}`, found {body.count(LOOP)}")
    loop_at = body.index(LOOP)
    loop_open = body.index("{", loop_at)
    loop_close = _match_brace(body, loop_open)
    loop_body = body[loop_open:loop_close]
    if not re.search(r"inpL\s*=\s*cur\s*;\s*$", loop_body):
        raise TransformError("the layer loop does not end with `inpL = cur;`")
    if "build_stage_boundary" in body:
        raise TransformError("already transformed")
    if body.count(LAST) < 1:
        raise TransformError(f"no `{LAST}` (output-row selection) in the layer loop")
    if body.count(LAST, loop_open, loop_close) != body.count(LAST):
        raise TransformError(f"`{LAST}` outside the layer loop")
    tail = body[loop_close:]
    if "model.output_norm" not in tail and "model.output" not in tail:
        raise TransformError("no output head after the layer loop")
    indent = re.search(r"\n([ \t]*)[^\n]*$", body[:loop_at]).group(1)
    boundary = (
        f"\n{indent}// skippy: a stage that is not the last hands on the pre-norm hidden state\n"
        f"{indent}if (build_stage_boundary(inpL)) {{\n{indent}    return;\n{indent}}}"
    )
    new_body = (
        body[:loop_at] + LOOP_NEW + body[loop_at + len(LOOP):loop_close + 1] + boundary + body[loop_close + 1:]
    )
    new_body = new_body.replace(LAST, LAST_NEW)
    # a row selection that does not test for the output ids (a stage that is not the last has none)
    new_body = new_body.replace(f"if ({LAST_NEW}) {{", f"if ({LAST_NEW} && inp_out_ids) {{")
    findings: list[str] = []
    guards = new_body.count(EMBD_GUARD[0])
    new_body = new_body.replace(EMBD_GUARD[0], EMBD_GUARD[1])
    new_body = new_body.replace(INPUT_SCALE[0], INPUT_SCALE[1])
    per_layer = "project_per_layer_inputs(" in new_body
    for old, new, count in PER_LAYER_EDITS if per_layer else []:
        found = new_body.count(old)
        if found != count:
            raise TransformError(f"per-layer token embeddings: edit {old!r}: expected {count} match(es), found {found}")
        new_body = new_body.replace(old, new)
    rest = text[end:]
    for old, new, count in PER_LAYER_HELPER_EDITS if per_layer else []:
        found = rest.count(old)
        if found != count:
            raise TransformError(f"per-layer token embeddings: helper edit {old!r}: expected {count} match(es), found {found}")
        rest = rest.replace(old, new)
    for old, new, count in ARCH_EDITS.get(arch.name, []):
        found = new_body.count(old)
        if found != count:
            raise TransformError(f"edit {old!r}: expected {count} match(es), found {found}")
        new_body = new_body.replace(old, new)
    # lint what is left in the graph body
    scan = new_body.replace(LOOP_NEW, "").replace(LAST_NEW, "").replace(EMBD_GUARD[1], "")
    scan = scan.replace("build_inp_embd(model.tok_embd)", "").replace(INPUT_SCALE[1], "")
    for _, new, _ in PER_LAYER_EDITS if per_layer else []:
        scan = scan.replace(new, "")
    # anything else done to the input between the embedding and the layer loop runs on every stage
    prelude = new_body[: new_body.index(LOOP_NEW)].replace("inpL = build_inp_embd(model.tok_embd);", "")
    prelude = prelude.replace(INPUT_SCALE[1], "")
    for _, new, _ in PER_LAYER_EDITS if per_layer else []:
        prelude = prelude.replace(new, "")
    if re.search(r"\binpL\s*=", prelude) and "input op" not in REVIEWED.get(arch.name, {}):
        findings.append("transforms the input before the layer loop (it would run on every stage)")
    for label, pattern in LINT.items():
        if pattern.search(scan) and label not in REVIEWED.get(arch.name, {}):
            findings.append(f"uses {label} outside the layer loop")
    if guards and arch.name not in {"glm4", "glm4moe"} and "ubatch.embd" not in REVIEWED.get(arch.name, {}):
        findings.append("guards on embedding input")
    return text[:start] + new_body + rest, findings


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
        elif "LLM_KV_HYPER_CONNECTION_COUNT" in joined:
            arch.reason = ("hyper-connections: layers hand on hc_mult parallel residual streams "
                           "(hc_mult x n_embd per token), wider than the n_embd-wide hidden state of a frame")
        elif "altup_predict_coef" in joined:
            arch.reason = ("AltUp: layers hand on n_altup parallel predictions of the hidden state "
                           "(n_altup x n_embd per token), wider than the n_embd-wide hidden state of a frame")
        else:
            main = [name for name, body in texts.items() if "build_inp_embd(model.tok_embd)" in body]
            if len(main) != 1:
                arch.reason = "graph does not follow the standard layer loop (no single token-input graph)"
                continue
            try:
                new_text, findings = transform(arch, texts[main[0]])
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
            else:
                arch.reason = ("not validated: the layer-loop rules apply, but no synthetic writer and "
                               "exactness test cover it yet")
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
    for arch in sorted((a for a in archs if a.status == "splits"), key=lambda a: list(a.new_text)[0]):
        for path, new_text in arch.new_text.items():
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
    lines += ["})", "", "#: Every other architecture llama.cpp knows, with the reason it is refused.",
              "REFUSED: Final[dict[str, str]] = {"]
    for arch in archs:
        if arch.status != "splits":
            lines.append(f"    {arch.name!r}: {arch.reason!r},")
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
        "nearest legal ones.",
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
