"""Window FIFO: commits, authoritative positions, stale windows, errors; the decoder end to end."""

from __future__ import annotations

import pytest

from skippy.driver.speculation import (
    ControllerConfig,
    CostModel,
    SpeculationConfig,
    SpeculativeDecoder,
    UnknownWindowError,
    Verdict,
    WindowOrderError,
    WindowShapeError,
    WindowTracker,
)


def test_epoch_window_partial_accept_rolls_back() -> None:
    tracker = WindowTracker(pending_token=50, pending_position=10)
    window = tracker.open_epoch([1, 2, 3])
    assert (window.base_position, window.inputs, window.drafts) == (10, (50, 1, 2, 3), (1, 2, 3))
    outcome = tracker.on_reply(window.id, [1, 9, 7, 7])
    assert outcome.tokens == (1, 9) and outcome.accepted == 1 and outcome.proposed == 3
    assert outcome.next_position == 12 and outcome.rollback and outcome.diverged
    assert (tracker.pending_token, tracker.pending_position) == (9, 12)
    assert tracker.usage.as_dict() == {"proposed": 3, "accepted": 1, "windows": 1, "rollbacks": 1, "stale_windows": 0}


def test_full_accept_and_plain_steps() -> None:
    tracker = WindowTracker(pending_token=50, pending_position=10)
    window = tracker.open_epoch([1, 2])
    outcome = tracker.on_reply(window.id, [1, 2, 3])
    assert outcome.tokens == (1, 2, 3) and not outcome.rollback and outcome.next_position == 13
    step = tracker.open_epoch([])
    assert step.inputs == (3,) and step.base_position == 13
    assert tracker.on_reply(step.id, [4]).tokens == (4,)
    assert tracker.pending_position == 14
    assert tracker.usage.windows == 1 and tracker.usage.rollbacks == 0


def test_pipelined_windows_continue_on_matching_boundary() -> None:
    tracker = WindowTracker(pending_token=50, pending_position=10)
    first = tracker.open_epoch([1, 2])
    second = tracker.open_continuation([3, 4, 5])
    assert second.base_position == 13 and tracker.optimistic_tail == (1, 2, 3, 4, 5)
    assert tracker.on_reply(first.id, [1, 2, 3]).tokens == (1, 2, 3)
    outcome = tracker.on_reply(second.id, [4, 5, 6])
    assert outcome.tokens == (4, 5, 6) and outcome.accepted == 3 and outcome.proposed == 3
    assert tracker.pending_position == 16
    assert tracker.usage.accepted == 5 and tracker.usage.proposed == 5


def test_the_tail_drops_a_committed_boundary() -> None:
    """Once the window before a continuation is committed, the continuation's boundary guess is the
    pending token (history): the tail that drafts the next window must not repeat it (it did, so
    every third pipelined window of a loop drafted one token twice and was rejected)."""
    tracker = WindowTracker(pending_token=50, pending_position=10)
    first = tracker.open_epoch([1, 2])
    tracker.open_continuation([3, 4, 5])
    assert tracker.optimistic_tail == (1, 2, 3, 4, 5)
    assert tracker.on_reply(first.id, [1, 2, 3]).tokens == (1, 2, 3)
    assert tracker.pending_token == 3 and tracker.optimistic_tail == (4, 5)


@pytest.mark.parametrize(("window", "depth"), [(2, 3), (3, 4), (4, 2), (5, 4)])
def test_pipelined_loop_never_rolls_back(window: int, depth: int) -> None:
    """A period-7 loop drafted several windows deep: every draft is right."""
    loop = [101, 102, 103, 104, 105, 106, 107] * 20
    prompt, stream = loop[:40], loop[40:120]
    decoder = SpeculativeDecoder(prompt, stream[0], max_tokens=len(stream), config=SpeculationConfig(
        controller=ControllerConfig(max_depth=depth, max_window=window)))
    decoder.controller.cost = CostModel(0.25, 8.0)
    decoder.controller.observe_traversal(1, 0.030, 0.010)  # a long round trip: pipelining pays
    for _ in range(20):
        decoder.controller.observe_outcome(40, 3, 3)
    run(decoder, loop)
    assert decoder.generated == stream
    assert decoder.usage.rollbacks == 0 and decoder.usage.stale_windows == 0
    assert decoder.usage.accepted == decoder.usage.proposed > len(stream) / 2


def test_boundary_miss_makes_later_windows_stale() -> None:
    tracker = WindowTracker(pending_token=50, pending_position=10)
    first = tracker.open_epoch([1, 2])
    second = tracker.open_continuation([3, 4])
    third = tracker.open_continuation([5])
    outcome = tracker.on_reply(first.id, [1, 2, 8])
    assert outcome.tokens == (1, 2, 8) and outcome.diverged and outcome.next_position == 13
    assert tracker.live == () and tracker.in_flight == 2
    restart = tracker.open_epoch([9])  # a new epoch goes out while stale replies drain
    assert restart.base_position == 13 and restart.inputs == (8, 9)
    for stale in (second, third):
        drained = tracker.on_reply(stale.id, [0] * len(stale.inputs))
        assert drained.stale and drained.tokens == ()
    assert tracker.on_reply(restart.id, [9, 4]).tokens == (9, 4)
    assert tracker.usage.stale_windows == 2 and tracker.usage.rollbacks == 1


def test_rejection_inside_a_pipelined_window() -> None:
    tracker = WindowTracker(pending_token=50, pending_position=0)
    first = tracker.open_epoch([1, 2, 3])
    tracker.open_continuation([4, 5])
    outcome = tracker.on_reply(first.id, [1, 7, 0, 0])
    assert outcome.tokens == (1, 7) and outcome.next_position == 2 and outcome.rollback
    assert tracker.live == ()


def test_reply_errors() -> None:
    tracker = WindowTracker(pending_token=1, pending_position=0)
    with pytest.raises(UnknownWindowError):
        tracker.on_reply(1, [1])
    first = tracker.open_epoch([2])
    second = tracker.open_continuation([3])
    with pytest.raises(WindowOrderError, match="out of order"):
        tracker.on_reply(second.id, [3])
    with pytest.raises(UnknownWindowError, match="unknown id 77"):
        tracker.on_reply(77, [3, 3])
    with pytest.raises(WindowShapeError, match="sent 2 tokens but the reply has 3"):
        tracker.on_reply(first.id, [2, 3, 4])
    assert tracker.in_flight == 2  # a refused reply leaves the FIFO untouched


def test_request_errors() -> None:
    tracker = WindowTracker(pending_token=1, pending_position=0)
    with pytest.raises(WindowShapeError, match="needs a live window"):
        tracker.open_continuation([1])
    window = tracker.open_epoch([2])
    with pytest.raises(WindowShapeError, match="no live window"):
        tracker.open_epoch([3])
    with pytest.raises(WindowShapeError, match="at least one draft"):
        tracker.open_continuation([])
    taken = tracker.take_reply(window.id, 2)
    with pytest.raises(WindowShapeError, match="does not fit"):
        tracker.commit(taken, Verdict(2, (2, 3, 4)))


def test_window_limit() -> None:
    tracker = WindowTracker(pending_token=1, pending_position=0)
    tracker.open_epoch([1])
    for _ in range(63):
        tracker.open_continuation([1])
    with pytest.raises(WindowShapeError, match="more than 64"):
        tracker.open_continuation([1])


# ------------------------------------------------------------------------------------ decoder


def run(decoder: SpeculativeDecoder, full: list[int], rtt: float = 0.02, row: float = 0.002) -> None:
    """Drive the decoder against a target that continues ``full`` (FIFO replies)."""
    queue = []
    while not decoder.done:
        while (request := decoder.next_window()) is not None:
            queue.append(request)
        request = queue.pop(0)
        predicted = [full[request.base_position + i + 1] for i in range(len(request.tokens))]
        rows = len(request.tokens)
        decoder.on_reply(request.window_id, predicted, wall_seconds=rtt + 0.01 + row * rows,
                         compute_seconds=0.01 + row * (rows - 1))


@pytest.mark.parametrize("depth", [1, 4])
def test_decoder_greedy_output_is_unchanged(depth: int) -> None:
    block = [int(t) for t in range(100, 130)]
    prompt = block + [5] + block
    stream = block[:10] + [7] + block * 3
    full = prompt + stream
    decoder = SpeculativeDecoder(prompt, stream[0], max_tokens=len(stream),
                                 config=SpeculationConfig(controller=ControllerConfig(max_depth=depth)))
    run(decoder, full)
    assert decoder.generated == stream
    assert decoder.usage.accepted > 0.7 * len(stream)
    assert decoder.usage.windows < len(stream) / 3
    assert decoder.kv_length >= len(prompt) + len(stream) - 1


def test_decoder_opt_out_sends_plain_steps() -> None:
    prompt = [1, 2, 3, 1, 2, 3]
    stream = [1, 2, 3, 1, 2, 3]
    decoder = SpeculativeDecoder(prompt, stream[0], max_tokens=len(stream), config=SpeculationConfig(enabled=False))
    seen = []
    while not decoder.done:
        request = decoder.next_window()
        assert request is not None and request.is_decode
        seen.append(request.base_position)
        decoder.on_reply(request.window_id, [(prompt + stream)[request.base_position + 1]])
    assert decoder.generated == stream and seen == [6, 7, 8, 9, 10]
    assert decoder.usage.windows == 0 and decoder.next_window() is None


def test_plain_steps_score_a_whole_shadow_draft() -> None:
    """While off, the plain steps' tokens judge a draft token by token, so the rate of drafts
    after the first is measured too (first drafts alone taught one rate for both, and long
    windows went out and lost)."""
    prompt = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9]
    stream = [5, 6, 40, 41, 42, 5, 6, 43, 44, 45, 5, 6, 46, 47, 48, 5, 6, 49, 50, 51] * 2
    off = ControllerConfig(min_gain=50.0, probe_interval=10**6)
    decoder = SpeculativeDecoder(prompt, stream[0], max_tokens=len(stream), config=SpeculationConfig(controller=off))
    run(decoder, prompt + stream)
    assert decoder.generated == stream and decoder.usage.windows == 0
    control = decoder.controller
    later = control.later_pooled
    assert later.trials >= 4  # drafts after the first were judged without a window
    first = control.pooled
    assert first.trials >= 4 and 0.0 < later.successes < later.trials  # hits and misses of both


def test_a_rejected_window_caps_the_next_one() -> None:
    """Slow start: after a window kept 1 draft of 6, the next carries at most 3 (on a CPU chain
    whose windows cost more than a plain step: the peer benchmark sent a 9-row window right after
    a 7-row one had failed); windows that cost less than a plain step are never capped."""
    loop = [101, 102, 103, 104, 105, 106, 107] * 20
    decoder = SpeculativeDecoder(loop[:40], loop[40], max_tokens=60)
    control = decoder.controller
    control.observe_traversal(1, 0.0205, 0.0194)  # llama-16x1024 F16 on one CPU thread
    control.observe_traversal(7, 0.0810, 0.0800)
    for _ in range(60):
        control.observe_outcome(40, 8, 8)
    first = decoder.next_window()
    assert first is not None and len(first.tokens) == 9
    wrong = list(loop[41:50])
    wrong[2] = 999  # the target keeps one draft, then disagrees
    decoder.on_reply(first.window_id, wrong)
    second = decoder.next_window()
    assert second is not None and len(second.tokens) - 1 <= 3
    cheap = SpeculativeDecoder(loop[:40], loop[40], max_tokens=60)
    cheap.controller.cost = controller_cost = CostModel(0.25, 8.0)
    controller_cost.observe(1, 0.022, 0.002)  # a 20 ms round trip, 2 ms a step, rows ~free
    controller_cost.observe(9, 0.0236, 0.0036)
    for _ in range(60):
        cheap.controller.observe_outcome(40, 8, 8)
    first = cheap.next_window()
    assert first is not None
    cheap.on_reply(first.window_id, [999] * len(first.tokens))  # nothing kept
    assert cheap._cap == 1 and cheap._window_cap() == 8  # a window costs less than a plain step
