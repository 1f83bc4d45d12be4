"""The sampling extension (docs/protocol.md §10): grammar sampling and logprobs through a chain.

The codec tests pin the two new reply frames byte for byte in both implementations (whole, one
byte at a time, malformed).  The runtime tests sample the generated tiny llama under GBNF
grammars with llama.cpp's grammar sampler (greedy and drawn, the grammar beside the chain and
inside it) and drive a grammar into a dead end, which must be refused, not abort the process.
The chain tests run stage servers in this trio run: the real tiny llama split in two, where every
answer must follow its grammar and the logprobs must be the unsplit model's log-softmax; the null
runtime for the relay rules (a plain v11 client sees no new frame; a refused grammar closes the
lane naming why); and a v11-style final stage, which never confirms, so the driver refuses the
request instead of running it unconstrained.
"""

from __future__ import annotations

import importlib
import json
import math
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import trio

from skippy.codec.protocol import WireError
from skippy.codec.protocol_ext import (
    GRAMMAR_FEATURE,
    LOGPROBS_FEATURE,
    MAX_TOP_LOGPROBS,
    SAMPLING_EXTENSION_FLAG,
    ErrorCode,
    LogprobsFrame,
    SamplingAcceptedFrame,
    SamplingRequest,
    TokenLogprobs,
)
from skippy.driver import StageClient
from skippy.driver.client import StageRemoteError
from skippy.driver.generator import GenerationRequest, Generator
from skippy.driver.prefix import SamplingExtensionRefused
from skippy.runtime import Model, StageContext
from skippy.runtime.ffi import ffi, lib
from skippy.runtime.sampling import (
    MAX_GRAMMAR_NESTING,
    GrammarDeadEnd,
    Sampler,
    SamplingParams,
    check_grammar_text,
)
from skippy.stage.executor import logprobs_of_row

sys.path.insert(0, str(Path(__file__).parent))
from stage_helpers import inprocess_chain  # noqa: E402

IMPLEMENTATIONS = {"py": "skippy.codec._wire_py", "c": "skippy.codec._wire"}
#: A grammar with a finite language: the answer is one of four short sentences.
WORD_GRAMMAR = 'root ::= ("yes" | "no") " " ("red" | "blue") "."'
WORDS = {f"{a} {b}." for a in ("yes", "no") for b in ("red", "blue")}


@pytest.fixture(params=sorted(IMPLEMENTATIONS))
def wire_impl(request: pytest.FixtureRequest) -> ModuleType:
    module = importlib.import_module(IMPLEMENTATIONS[request.param])
    assert module.IMPLEMENTATION == {"py": "python", "c": "cython"}[request.param]
    return module


# -- codec ------------------------------------------------------------------------------------------
ACCEPTED = SamplingAcceptedFrame(GRAMMAR_FEATURE | LOGPROBS_FEATURE)
ACCEPTED_HEX = "035e0000" "03000000"
LOGPROBS = LogprobsFrame(1, (TokenLogprobs(5, -0.5, ((7, -0.25),)), TokenLogprobs(2, -3.0, ((2, -3.0),))))
LOGPROBS_HEX = ("045e0000" "02000000" "01000000"
                "05000000" "000000bf" "07000000" "000080be"
                "02000000" "000040c0" "02000000" "000040c0")


def _frames(impl: ModuleType, data: bytes, *, bytewise: bool = False) -> list[object]:
    from skippy.codec.protocol import NEED_DATA

    decoder = impl.ReplyDecoder(extensions=True)
    out: list[object] = []
    for chunk in ([bytes([b]) for b in data] if bytewise else [data]):
        decoder.receive_data(chunk)
        while (item := decoder.next_reply()) is not NEED_DATA:
            out.append(item)
    return out


@pytest.mark.parametrize(("frame", "hex_bytes"), [(ACCEPTED, ACCEPTED_HEX), (LOGPROBS, LOGPROBS_HEX)],
                         ids=["sampling-accepted", "logprobs"])
def test_the_new_frames_encode_and_decode_byte_for_byte(wire_impl: ModuleType, frame: object, hex_bytes: str) -> None:
    encode = wire_impl.encode_sampling_accepted if isinstance(frame, SamplingAcceptedFrame) else wire_impl.encode_logprobs
    data = encode(frame)
    assert data.hex() == hex_bytes
    from skippy.codec.protocol import StageReply

    stream = data + wire_impl.encode_reply(StageReply.predicted_token(5))
    for bytewise in (False, True):
        decoded = _frames(wire_impl, stream, bytewise=bytewise)
        assert decoded[0] == frame and decoded[1] == StageReply.predicted_token(5)


@pytest.mark.parametrize(("hex_bytes", "reason", "field"), [
    ("035e0000" "08000000", "unknown sampling feature bits", "features"),
    ("045e0000" "01100000" "00000000", "logprob row count out of range", "logprob_row_count"),
    ("045e0000" "ffffffff" "00000000", "logprob row count out of range", "logprob_row_count"),
    ("045e0000" "01000000" "15000000", "top logprob count out of range", "top_logprob_count"),
    ("045e0000" "01000000" "00000000" "ffffffff" "000000bf", "logprob token out of range", "logprobs[0].token"),
    ("045e0000" "01000000" "00000000" "01000000" "0000003f", "logprob out of range", "logprobs[0].logprob"),
    ("045e0000" "01000000" "00000000" "01000000" "0000c07f", "logprob out of range", "logprobs[0].logprob"),
    ("045e0000" "01000000" "01000000" "01000000" "000000bf" "02000000" "000080ff", "logprob out of range",
     "logprobs[0].top[0].logprob"),
], ids=["features", "rows", "negative-rows", "top", "token", "positive", "nan", "minus-infinity"])
def test_malformed_frames_raise_wire_errors_naming_the_field(wire_impl: ModuleType, hex_bytes: str, reason: str,
                                                               field: str) -> None:
    for bytewise in (False, True):
        with pytest.raises(WireError) as raised:
            _frames(wire_impl, bytes.fromhex(hex_bytes), bytewise=bytewise)
        assert raised.value.reason == reason and raised.value.field == field


def test_the_size_fields_are_refused_before_the_frame_is_complete(wire_impl: ModuleType) -> None:
    # 4096 + 1 rows: refused from the 12-byte head, nothing sized from it
    with pytest.raises(WireError, match="logprob row count"):
        _frames(wire_impl, bytes.fromhex("045e0000" "01100000" "00000000"))


def test_a_decoder_without_extensions_refuses_the_new_kinds_as_v11_does(wire_impl: ModuleType) -> None:
    decoder = wire_impl.ReplyDecoder()
    decoder.receive_data(bytes.fromhex(ACCEPTED_HEX))
    with pytest.raises(WireError, match="unknown stage reply kind"):
        decoder.next_reply()


@pytest.mark.parametrize("frame", [
    SamplingAcceptedFrame(8),
    LogprobsFrame(21, ()),
    LogprobsFrame(1, (TokenLogprobs(1, -1.0, ()),)),  # one alternative promised, none given
    LogprobsFrame(0, (TokenLogprobs(1, 0.5),)),
    LogprobsFrame(0, (TokenLogprobs(-1, -0.5),)),
], ids=["features", "top", "short-row", "positive", "negative-token"])
def test_the_encoders_refuse_what_the_decoder_would(wire_impl: ModuleType, frame: object) -> None:
    encode = wire_impl.encode_sampling_accepted if isinstance(frame, SamplingAcceptedFrame) else wire_impl.encode_logprobs
    with pytest.raises(WireError):
        encode(frame)


@pytest.mark.parametrize("section", [
    None, [], {"grammar": 5}, {"grammar_root": ""}, {"logprobs": -1}, {"logprobs": MAX_TOP_LOGPROBS + 1},
    {"logprobs": True}, {"logprobs": 1.5},
])
def test_the_metadata_section_is_checked_field_by_field(section: object) -> None:
    with pytest.raises(ValueError, match="skippy.sampling"):
        SamplingRequest.from_section(section)


def test_the_metadata_section_round_trips() -> None:
    request = SamplingRequest("root ::= \"a\"", "root", 3)
    assert SamplingRequest.from_section(json.loads(json.dumps(request.section()))) == request
    assert request.features == GRAMMAR_FEATURE | LOGPROBS_FEATURE


# -- grammar text bounds, logprobs arithmetic -------------------------------------------------------
def test_grammar_text_is_bounded_before_llama_cpp_parses_it() -> None:
    check_grammar_text('root ::= "(((" [(] # ((((\n')  # parentheses in literals, classes, comments
    deep = "root ::= " + "(" * (MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (MAX_GRAMMAR_NESTING + 1)
    with pytest.raises(ValueError, match="nests groups"):
        check_grammar_text(deep)
    with pytest.raises(ValueError, match="bytes"):
        check_grammar_text('root ::= "' + "a" * (256 * 1024) + '"')
    with pytest.raises(ValueError, match="NUL"):
        SamplingParams(grammar='root ::= "\0"')


def test_logprobs_of_a_row_are_its_log_softmax_with_the_top_tokens_first() -> None:
    logits = np.array([0.5, 3.0, -1.0, 3.0, 2.0], dtype=np.float32)
    expected = logits.astype(np.float64) - math.log(np.exp(logits.astype(np.float64)).sum())
    row = logprobs_of_row(logits, 4, 3)
    assert row.token == 4 and row.logprob == pytest.approx(expected[4], abs=1e-12)
    assert [t for t, _ in row.top] == [1, 3, 4]  # a tie: the lower id first
    assert [lp for _, lp in row.top] == pytest.approx([expected[1], expected[3], expected[4]], abs=1e-12)
    assert logprobs_of_row(logits, 2, 0).top == ()


# -- the runtime: grammar sampling on the tiny llama ------------------------------------------------
def _run(model: Model, context: StageContext, sampler: Sampler, prompt: list[int], steps: int) -> list[int]:
    seq = context.open_session()
    try:
        context.decode(positions=np.arange(len(prompt), dtype=np.int32), seq_ids=np.full(len(prompt), seq, np.int32),
                       tokens=np.asarray(prompt, dtype=np.int32))
        out: list[int] = []
        for position in range(len(prompt), len(prompt) + steps):
            token = int(context.sample([sampler], [int(context.output_rows[-1])])[0])
            if model.is_end_of_generation(token):
                break
            out.append(token)
            context.decode(positions=np.array([position], np.int32), seq_ids=np.array([seq], np.int32),
                           tokens=np.array([token], np.int32))
        return out
    finally:
        context.close_session(seq)


@pytest.mark.parametrize("params", [
    SamplingParams(grammar=WORD_GRAMMAR),
    SamplingParams(temperature=1.0, seed=7, grammar=WORD_GRAMMAR),
    SamplingParams(temperature=1.0, top_k=40, top_p=0.9, seed=7, grammar=WORD_GRAMMAR),
], ids=["greedy", "temperature", "top-k-top-p"])
def test_every_answer_follows_the_grammar(tiny_llama: Path, params: SamplingParams) -> None:
    from skippy.runtime.tokenizer import Tokenizer

    with Tokenizer(tiny_llama) as tokenizer, Model(tiny_llama) as model, \
            StageContext(model, n_ctx=128, n_batch=32, threads=1) as context:
        prompt = tokenizer.encode("The answer is")
        for seed in range(3):
            with Sampler(SamplingParams(**{**_fields(params), "seed": seed}), model.n_vocab,
                         model.vocab_pointer) as sampler:
                assert sampler.checked and not sampler.plain_greedy
                # greedy / temperature alone keep the grammar beside the chain; top-k / top-p inside it
                assert (sampler.grammar_pointer != ffi.NULL) == (params.top_k == 0)
                text = tokenizer.decode(_run(model, context, sampler, prompt, 24))
            assert text in WORDS


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__dataclass_fields__}


def test_a_grammar_that_does_not_parse_is_refused_naming_llama_cpp_s_reason(tiny_llama: Path) -> None:
    with Model(tiny_llama) as model:
        with pytest.raises(ValueError, match="does not parse"):
            Sampler(SamplingParams(grammar="root ::= ("), model.n_vocab, model.vocab_pointer)
        with pytest.raises(ValueError, match="does not parse"):
            Sampler(SamplingParams(grammar='start ::= "a"'), model.n_vocab, model.vocab_pointer)  # no root
        with pytest.raises(ValueError, match="vocabulary"):
            Sampler(SamplingParams(grammar=WORD_GRAMMAR), model.n_vocab)


@pytest.mark.parametrize("beside", [True, False], ids=["beside", "in-chain"])
def test_a_grammar_dead_end_is_refused_not_accepted(tiny_llama: Path, beside: bool) -> None:
    # every token the grammar allows has a -inf logit: llama.cpp would pick a forbidden token and
    # throw when the grammar accepted it; the checked path refuses and accepts nothing
    with Model(tiny_llama) as model:
        params = SamplingParams(grammar='root ::= "a"') if beside else SamplingParams(
            temperature=1.0, top_k=5, grammar='root ::= "a"')
        with Sampler(params, model.n_vocab, model.vocab_pointer) as sampler:
            logits = np.full(model.n_vocab, -np.inf, dtype=np.float32)
            from skippy.runtime.tokenizer import Tokenizer

            with Tokenizer(tiny_llama) as tokenizer:
                logits[tokenizer.encode("b", add_special=False)[-1]] = 1.0
            scratch = ffi.new("llama_token_data[]", model.n_vocab)
            out = ffi.new("llama_token *")
            pointer = ffi.cast("float *", ffi.from_buffer(logits))
            assert lib.skippy_sample_row_checked(sampler.pointer, sampler.grammar_pointer, pointer, model.n_vocab,
                                                 scratch, out) == -1
            with pytest.raises(ValueError, match="grammar sampler"):
                sampler.accept(5)
    assert issubclass(GrammarDeadEnd, Exception)


# -- chains in this trio run ------------------------------------------------------------------------
async def test_a_split_chain_answers_under_the_grammar_with_the_unsplit_logprobs(tiny_llama: Path) -> None:
    generator = Generator.from_model(tiny_llama, n_ctx=256)
    try:
        prompt = tuple(generator.encode("Is the sky red?"))
        async with inprocess_chain(["0:2", "2:4"], model=str(tiny_llama), ctx_size=256, threads=1) as servers:
            async with await StageClient.connect(servers[0].address) as client:
                for session, seed in enumerate(range(4), start=1):
                    request = GenerationRequest(prompt, 24, SamplingParams(temperature=1.0, seed=seed),
                                                grammar=WORD_GRAMMAR, speculation=True)
                    completion = await generator.generate(client, request, session)
                    assert completion.text in WORDS and completion.finish_reason == "stop"
                    assert completion.speculation is None  # a grammar never speculates
                request = GenerationRequest(prompt, 8, SamplingParams(), logprobs=4)
                completion = await generator.generate(client, request, 9)
        assert completion.logprobs is not None and len(completion.logprobs) == len(completion.tokens)
        with Model(tiny_llama) as model, StageContext(model, n_ctx=256, n_batch=64, threads=1) as context:
            seq = context.open_session()
            tokens = list(prompt) + completion.tokens
            context.decode(positions=np.arange(len(tokens), dtype=np.int32), seq_ids=np.full(len(tokens), seq, np.int32),
                           tokens=np.asarray(tokens, np.int32), outputs=np.ones(len(tokens), bool))
            for index, row in enumerate(completion.logprobs):
                logits = context.logits(len(prompt) - 1 + index).astype(np.float64)
                expected = logits - (logits.max() + math.log(np.exp(logits - logits.max()).sum()))
                assert row.token == completion.tokens[index] == int(np.argmax(logits))  # greedy
                assert row.logprob == pytest.approx(expected[row.token], abs=1e-4)
                assert [t for t, _ in row.top] == list(np.argsort(-expected, kind="stable")[:4])
                assert [lp for _, lp in row.top] == pytest.approx(sorted(expected, reverse=True)[:4], abs=1e-4)
        assert all(server.stats.connection_errors == 0 for server in servers)
    finally:
        generator.close()


async def test_logprobs_are_relayed_only_to_a_lane_that_negotiated_them() -> None:
    async with inprocess_chain(["0:2", "2:4"]) as servers:
        for extensions in (True, False):
            async with await StageClient.connect(servers[0].address, extensions=extensions) as client:
                metadata = json.dumps({"skippy.sampling": SamplingRequest(logprobs=2).section()})
                await client.configure(1, prompt_token_count=3, metadata=metadata, flags=SAMPLING_EXTENSION_FLAG)
                assert client.last_accepted == (SamplingAcceptedFrame(LOGPROBS_FEATURE) if extensions else None)
                result = await client.prefill(1, [1, 2, 3], chunk_size=2)
                frame = client.last_logprobs
                if extensions:
                    # the null runtime's logits: 1.0 at the prediction, 0 elsewhere (1000 tokens)
                    assert frame is not None and frame.top_count == 2 and len(frame.rows) == 1
                    row = frame.rows[0]
                    assert row.token == result.token and row.top[0][0] == result.token
                    assert row.logprob == pytest.approx(1.0 - math.log(math.e + 999), abs=1e-6)
                else:
                    assert frame is None
                await client.stop(1)
        assert all(server.stats.connection_errors == 0 for server in servers)


async def test_a_grammar_the_final_stage_cannot_install_closes_the_lane_naming_why() -> None:
    async with inprocess_chain(["0:2", "2:4"]) as servers:  # the null runtime has no vocabulary
        async with await StageClient.connect(servers[0].address) as client:
            metadata = json.dumps({"skippy.sampling": SamplingRequest(grammar=WORD_GRAMMAR).section()})
            with pytest.raises(StageRemoteError, match="sampling extension refused") as raised:
                await client.configure(1, prompt_token_count=3, metadata=metadata, flags=SAMPLING_EXTENSION_FLAG)
            assert raised.value.code is ErrorCode.STATE_MISMATCH
        async with await StageClient.connect(servers[0].address) as client:  # the stage carries on
            await client.configure(2, prompt_token_count=3)
            assert (await client.prefill(2, [1, 2, 3], chunk_size=2)).token >= 0


async def _v11_final_stage(task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    """A stage that answers like a plain v11 one: READY, then an ACK per message (no extension frame)."""
    from skippy.codec.protocol import READY_BYTES, NEED_DATA, StageReply
    from skippy.stage.transport import codec

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")

    async def serve(stream: trio.SocketStream) -> None:
        await stream.send_all(READY_BYTES)
        decoder = codec.MessageDecoder(0)
        while data := await stream.receive_some(65536):
            decoder.receive_data(data)
            while (message := decoder.next_message()) is not NEED_DATA:
                await stream.send_all(codec.encode_reply(StageReply.ack()))
                del message

    task_status.started(listeners[0].socket.getsockname()[1])
    await trio.serve_listeners(serve, listeners)


async def test_the_driver_refuses_a_request_a_chain_does_not_confirm(tiny_llama: Path) -> None:
    generator = Generator.from_model(tiny_llama, n_ctx=256)
    try:
        async with trio.open_nursery() as nursery:
            port = await nursery.start(_v11_final_stage)
            async with await StageClient.connect(f"127.0.0.1:{port}") as client:
                request = GenerationRequest((1, 2, 3), 4, grammar=WORD_GRAMMAR)
                with pytest.raises(SamplingExtensionRefused, match="did not confirm the request's grammar"):
                    await generator.generate(client, request, 1)
            nursery.cancel_scope.cancel()
    finally:
        generator.close()


# -- the API's request fields (no server: skippy/api/structured.py alone) ----------------------------
def test_request_fields_become_a_grammar_and_a_logprobs_count(tiny_llama: Path) -> None:
    from skippy.api.errors import ApiError
    from skippy.api.structured import parse_constraints
    from skippy.runtime.tokenizer import Tokenizer

    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    with Tokenizer(tiny_llama) as tokenizer:
        constraints = parse_constraints({"response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": schema, "strict": True}}, "logprobs": True, "top_logprobs": 3}, True, tokenizer)
        assert constraints.json and constraints.logprobs == 3 and constraints.grammar is not None
        # JSON strings hold no raw control character (the converter's rule, corrected)
        assert any(line.startswith("char ::= [^\"\\\\\\x7F\\x00-\\x1F\\uD800-\\uDFFF\\U00110000-\\U001FFFFF]")
                   for line in constraints.grammar.splitlines())
        assert parse_constraints({}, True, tokenizer) == parse_constraints({"response_format": {"type": "text"}}, True,
                                                                           tokenizer)
        assert parse_constraints({"logprobs": 2}, False, tokenizer).logprobs == 2
        for body, chat, param in [
            ({"response_format": {"type": "json_object"}, "grammar": WORD_GRAMMAR}, True, "grammar"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": 5}}}}, True,
             "response_format.json_schema.schema"),
            ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "strict": "yes"}}}, True,
             "response_format.json_schema.strict"),
            ({"response_format": "json"}, True, "response_format"),
            ({"grammar": "root ::= ["}, False, "grammar"),
            ({"logprobs": "yes"}, True, "logprobs"),
            ({"logprobs": True, "top_logprobs": 21}, True, "top_logprobs"),
            ({"logprobs": 21}, False, "logprobs"),
        ]:
            with pytest.raises(ApiError) as raised:
                parse_constraints(body, chat, tokenizer)
            assert raised.value.status == 400 and raised.value.param == param, body
