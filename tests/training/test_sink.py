"""The hot-path sink driven directly, without FSDP or spawned ranks (milliseconds).

Oracles: numel x element size of the tensors handed in, and autograd itself (what it saves).
"""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from fsdp_mem_otel.schema import (
    ACTIVATION,
    AFTER_POST_BACKWARD,
    AFTER_POST_FORWARD,
    AFTER_PRE_BACKWARD,
    AFTER_PRE_FORWARD,
    ALL_GATHER,
    BEFORE_POST_BACKWARD,
    BEFORE_POST_FORWARD,
    BEFORE_PRE_BACKWARD,
    BEFORE_PRE_FORWARD,
    PEAK_FORWARD,
    TOTAL,
    UNSHARDED_PARAM,
)
from fsdp_mem_otel.training.adapters.base import tensors_in
from fsdp_mem_otel.training.deep import DeepMode
from fsdp_mem_otel.training.light.ledger import INDEX, Ledger
from fsdp_mem_otel.training.light.recorder import StepRecorder
from fsdp_mem_otel.training.light.sink import Sink


def _sink(**kwargs: object) -> tuple[Sink, Ledger, list[BaseException]]:
    ledger = Ledger()
    errors: list[BaseException] = []
    sink = Sink(ledger, StepRecorder(ledger), errors.append, **kwargs)  # type: ignore[arg-type]
    sink.active = True
    return sink, ledger, errors


def _forward(sink: Sink, key: str, inputs: object, body: object) -> torch.Tensor:
    sink.on_state(key, BEFORE_PRE_FORWARD)
    sink.on_state(key, AFTER_PRE_FORWARD, inputs)
    out = body()  # type: ignore[operator]
    sink.on_state(key, BEFORE_POST_FORWARD, out)
    sink.on_state(key, AFTER_POST_FORWARD, out)
    return out


def test_outputs_and_saved_tensors_count_as_activations() -> None:
    sink, ledger, errors = _sink()
    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)
    ledger.track(w, UNSHARDED_PARAM)  # known storages keep their category
    out = _forward(sink, "<root>", (x,), lambda: torch.tanh(x @ w))
    acts = ledger.current["cpu"][ACTIVATION]
    # x (the input), the tanh output (saved by tanh's backward and returned); w stays a parameter
    assert acts == x.numel() * 4 + out.numel() * 4
    assert ledger.current["cpu"][UNSHARDED_PARAM] == w.numel() * 4
    assert errors == []
    del out
    assert ledger.current["cpu"][ACTIVATION] == x.numel() * 4  # freed with the graph


def test_saved_tensor_hooks_only_during_the_outermost_forward() -> None:
    sink, ledger, _ = _sink()
    x = torch.randn(16, requires_grad=True)
    sink.on_state("<root>", BEFORE_PRE_FORWARD)
    sink.on_state("a", BEFORE_PRE_FORWARD)
    y = x.exp()  # saves its output: counted
    sink.on_state("a", BEFORE_POST_FORWARD, y)
    sink.on_state("a", AFTER_POST_FORWARD, y)
    z = y.exp()  # still inside the root's forward: counted
    sink.on_state("<root>", BEFORE_POST_FORWARD, z)
    sink.on_state("<root>", AFTER_POST_FORWARD, z)
    after = ledger.current["cpu"][ACTIVATION]
    w = z.exp()  # after the outermost forward: not seen
    assert after == (y.numel() + z.numel()) * 4
    assert ledger.current["cpu"][ACTIVATION] == after
    del w


def test_deep_steps_leave_activations_to_the_dispatch_mode() -> None:
    sink, ledger, _ = _sink()
    sink.deep = True
    x = torch.randn(16, requires_grad=True)
    _forward(sink, "<root>", (x,), lambda: x.exp())
    assert ledger.current.get("cpu", {}).get(ACTIVATION, 0) == 0


def test_integer_accounts_make_peaks_and_windows() -> None:
    sink, ledger, _ = _sink()
    sink.on_state("<root>", BEFORE_PRE_FORWARD)
    sink.add("cpu", INDEX[ALL_GATHER], 1000)
    sink.add("cpu", INDEX[UNSHARDED_PARAM], 4000)
    sink.add("cpu", INDEX[ALL_GATHER], -1000)
    sink.on_state("<root>", AFTER_POST_FORWARD)
    peak = sink.recorder.modules["<root>"].snapshots[PEAK_FORWARD][0]["cpu"]
    assert (peak[TOTAL], peak[ALL_GATHER], peak[UNSHARDED_PARAM]) == (5000, 1000, 4000)
    assert ledger.current["cpu"][TOTAL] == 4000


def test_hold_and_forget_keep_an_entry_without_bytes() -> None:
    sink, ledger, _ = _sink()
    t = torch.empty(100)
    sink.hold(t.untyped_storage(), UNSHARDED_PARAM)
    assert ledger.knows(t.untyped_storage()) and ledger.current == {}
    sink.track(t, ALL_GATHER)  # per-tensor accounting takes it: bytes and category
    assert ledger.current["cpu"][ALL_GATHER] == 400
    sink.forget(t.untyped_storage())  # released by FSDP, whoever still holds it
    assert ledger.current["cpu"][TOTAL] == 0 and ledger.knows(t.untyped_storage())
    del t
    assert len(ledger) == 0 and ledger.current["cpu"][TOTAL] == 0


def test_a_pending_deep_step_starts_at_the_first_forward_only() -> None:
    sink, _, _ = _sink()
    started: list[int] = []
    sink.on_forward = lambda: started.append(1)
    sink.forward_pending = True
    x = torch.randn(4)
    _forward(sink, "<root>", (x,), lambda: x + 1)
    _forward(sink, "<root>", (x,), lambda: x + 2)  # a second micro-batch
    assert started == [1]


def test_a_raising_forward_is_reported_once_per_state_without_outputs() -> None:
    sink, _, _ = _sink()
    seen: list[BaseException] = []
    sink.on_raising_forward = seen.append
    sink.on_state("<root>", BEFORE_PRE_FORWARD)
    try:
        raise RuntimeError("out of memory (injected)")
    except RuntimeError:
        sink.on_state("<root>", AFTER_POST_FORWARD)  # always_call hooks run with no outputs
    assert [str(e) for e in seen] == ["out of memory (injected)"]


def test_failures_are_contained_and_inactive_sinks_do_nothing() -> None:
    sink, ledger, errors = _sink()

    def broken() -> tuple[object, ...]:
        raise RuntimeError("broken ledger")

    ledger.snap = broken  # type: ignore[method-assign]
    sink.on_state("<root>", BEFORE_PRE_FORWARD)  # the snapshot fails: counted, not raised
    assert [str(e) for e in errors] == ["broken ledger"]
    sink.active = False
    sink.add("cpu", INDEX[ALL_GATHER], 100)
    sink.track(torch.empty(10), ACTIVATION)
    sink.on_state("<root>", AFTER_POST_FORWARD)
    assert ledger.current == {} and len(errors) == 1
    sink.end_step()  # as detach does: the hooks the first state pushed go with it
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_a_backends_own_buffer_ends_with_the_post_backward() -> None:
    sink, ledger, errors = _sink()
    sink.deep = True
    context = sink.recorder.context
    clone = torch.empty(1000)  # made where no op is seen, as gloo's clone inside its kernel
    mine = torch.empty(10)
    for state in (BEFORE_PRE_BACKWARD, AFTER_PRE_BACKWARD, BEFORE_POST_BACKWARD):
        sink.on_state("a", state)
    context.backend_buffers = []  # what deep mode does at a reduce-scatter in a post-backward
    with DeepMode(ledger, context, errors.append):
        doubled = mine * 2  # an op's output: counted as usual
        chunks = clone.split(250)  # the backend's wait: views of a storage never seen
        flat = doubled.view(-1)  # a view of a storage seen: not the backend's
    assert ledger.current["cpu"][TOTAL] == (1000 + 10) * 4
    sink.on_state("a", AFTER_POST_BACKWARD)  # FSDP's post-backward returned
    assert ledger.current["cpu"][TOTAL] == 10 * 4  # the clone left the accounts, still alive
    del chunks, clone
    assert ledger.current["cpu"][TOTAL] == 10 * 4  # its free subtracts nothing more
    del flat, doubled
    assert ledger.current.get("cpu", {}).get(TOTAL, 0) == 0
    assert context.backend_buffers is None and errors == []


def test_tensors_in_finds_every_tensor_in_order_through_containers_and_subclasses() -> None:
    # a forward hook's (args, kwargs): tuples, lists, dicts, their subclasses (namedtuple,
    # OrderedDict), Parameters and non-tensors mixed in
    pair = namedtuple("pair", "first second")
    a, b, c, d = (torch.randn(2) for _ in range(4))
    p = torch.nn.Parameter(torch.randn(3))
    inputs = ((a, None, 3, [pair(b, "x")]), {"mask": c, "nested": OrderedDict(w=p, more=(d,)), "flag": True})
    assert [id(t) for t in tensors_in(inputs)] == [id(t) for t in (a, b, c, p, d)]
    assert tensors_in(a)[0] is a and tensors_in(p)[0] is p
    assert tensors_in(((), {})) == [] and tensors_in(None) == [] and tensors_in("text") == []
    # a block's usual ``((x,), {})`` takes a shortcut: it must agree with the walk around it
    assert [id(t) for t in tensors_in(((a,), {}))] == [id(a)]
    assert [id(t) for t in tensors_in(((p,), {}))] == [id(p)]  # a subclass: walked, still found
    assert [id(t) for t in tensors_in(((a,), {"mask": c}))] == [id(a), id(c)]
    assert [id(t) for t in tensors_in((a, b))] == [id(a), id(b)]  # two outputs, not (args, kwargs)
    assert [id(t) for t in tensors_in(((a,), b))] == [id(a), id(b)]


def test_an_output_is_walked_once_unless_post_forward_replaces_it() -> None:
    import weakref

    sink, ledger, errors = _sink()
    walked: list[int] = []  # ids: the spy must hold no tensor
    walk = ledger.track_new_at
    ledger.track_new_at = lambda t, *a: (walked.append(id(t)), walk(t, *a))  # type: ignore[method-assign]
    x = torch.randn(4, 8)
    out = torch.randn(4, 8)
    sink.on_state("<root>", BEFORE_PRE_FORWARD)
    sink.on_state("<root>", BEFORE_POST_FORWARD, out)
    sink.on_state("<root>", AFTER_POST_FORWARD, out)  # FSDP's post-forward handed it back as it was
    assert walked == [id(out)]
    assert not errors
    # a post-forward that casts: the new output is an activation too
    sink.on_state("blocks.0", BEFORE_PRE_FORWARD)
    sink.on_state("blocks.0", BEFORE_POST_FORWARD, x)
    cast = x.double()
    sink.on_state("blocks.0", AFTER_POST_FORWARD, cast)
    assert walked == [id(out), id(x), id(cast)]
    assert ledger.current["cpu"][ACTIVATION] == (out.numel() + x.numel()) * 4 + cast.numel() * 8
    # the sink lets go of the output at after_post_forward, also when the forward raised
    gone = torch.randn(3)
    ref = weakref.ref(gone)
    sink.on_state("blocks.1", BEFORE_PRE_FORWARD)
    sink.on_state("blocks.1", BEFORE_POST_FORWARD, gone)
    sink.on_state("blocks.1", AFTER_POST_FORWARD)  # no outputs: the forward raised
    del gone
    assert ref() is None


def test_an_output_whose_first_walk_failed_is_walked_again() -> None:
    sink, ledger, errors = _sink()
    track_new_at = ledger.track_new_at  # how a module's outputs are walked
    fail = [True]

    def flaky(t: torch.Tensor, *a: object) -> None:
        if fail.pop() if fail else False:
            raise RuntimeError("broken once")
        track_new_at(t, *a)  # type: ignore[arg-type]

    ledger.track_new_at = flaky  # type: ignore[method-assign]
    out = torch.randn(4, 8)
    sink.on_state("<root>", BEFORE_PRE_FORWARD)
    sink.on_state("<root>", BEFORE_POST_FORWARD, out)
    sink.on_state("<root>", AFTER_POST_FORWARD, out)
    assert [str(e) for e in errors] == ["broken once"]  # contained and counted
    assert ledger.current["cpu"][ACTIVATION] == out.numel() * 4
