"""The light-mode pack hook on its own (no processes): what it hands autograd, and that nothing it
hands over keeps a dropped graph alive."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from fsdp_mem_otel.schema import ACTIVATION
from fsdp_mem_otel.training.light.activations import SavedTensorAccounting
from fsdp_mem_otel.training.light.ledger import Ledger


def _accounting() -> tuple[Ledger, SavedTensorAccounting, list[BaseException]]:
    ledger = Ledger()
    errors: list[BaseException] = []
    return ledger, SavedTensorAccounting(ledger, errors.append), errors


def test_leaves_go_as_they_are_and_the_rest_as_detached_aliases() -> None:
    ledger, acct, errors = _accounting()
    w = torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)
    h = torch.randn(4, 16, requires_grad=True) * 2  # not a leaf
    assert acct.push()
    try:
        assert acct._pack(w) == (w, w._version)
        assert acct._pack(x)[0] is x
        alias, version = acct._pack(h)  # type: ignore[misc]
    finally:
        acct.pop()
    assert alias is not h and alias.grad_fn is None and version == h._version
    assert alias.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    assert not errors
    # each storage counted once, as an activation (w and x are not known to the ledger otherwise)
    assert ledger.category_bytes(ACTIVATION) == (16 * 16 + 4 * 16 + 4 * 16) * 4


def test_a_pack_that_runs_after_its_pop_accounts_nothing() -> None:
    ledger, acct, errors = _accounting()
    h = torch.randn(4, 16, requires_grad=True) * 2
    saved, version = acct._pack(h)  # type: ignore[misc] # popped (never pushed here), yet called
    assert saved is not h and saved.untyped_storage().data_ptr() == h.untyped_storage().data_ptr()
    assert version == h._version  # autograd's check still made at unpack
    assert len(ledger) == 0 and ledger.category_bytes(ACTIVATION) == 0 and not errors


def test_pop_takes_ours_out_from_under_hooks_pushed_since() -> None:
    top = torch._C._autograd._top_saved_tensors_default_hooks
    _, acct, errors = _accounting()

    def theirs_pack(t: torch.Tensor) -> torch.Tensor:
        return t

    assert top(True) is None
    assert acct.push()
    with torch.autograd.graph.saved_tensors_hooks(theirs_pack, theirs_pack):
        acct.pop()  # ours are under theirs now
        assert top(True) == (theirs_pack, theirs_pack)  # theirs stay on top, until they pop them
    assert top(True) is None and not errors  # and nothing of ours is left


def test_gradients_equal_untracked_ones() -> None:
    torch.manual_seed(0)
    w1, w2 = torch.randn(16, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
    x = torch.randn(4, 16)

    def grads(push: bool) -> list[torch.Tensor]:
        _, acct, errors = _accounting()
        if push:
            acct.push()
        try:
            loss = torch.sigmoid(x @ w1).exp().mul(w2.sum()).sum()
        finally:
            acct.pop()
        g = torch.autograd.grad(loss, [w1, w2])
        assert not errors
        return list(g)

    for tracked, untracked in zip(grads(True), grads(False), strict=True):
        assert torch.equal(tracked, untracked)


def test_a_graph_dropped_without_backward_frees_what_it_saved() -> None:
    # sigmoid and exp save their outputs: held as themselves, each would keep its own grad_fn
    # (and so the graph and itself) alive after the graph is dropped
    ledger, acct, _ = _accounting()
    w = torch.randn(16, 16, requires_grad=True)
    acct.push()
    try:
        out = torch.sigmoid(torch.randn(4, 16) @ w).exp()
    finally:
        acct.pop()
    saved_output = weakref.ref(out)
    inner = weakref.ref(out.grad_fn._saved_result)  # type: ignore[union-attr]
    assert ledger.category_bytes(ACTIVATION) > 0
    del out
    gc.collect()
    assert saved_output() is None and inner() is None
    assert ledger.category_bytes(ACTIVATION) == 0  # mm saved the input alone (w needs no gradient of x)


def _modified_saved_tensor(push: bool, case: str) -> None:
    """A saved tensor changed in place before backward: autograd raises (without hooks)."""
    _, acct, errors = _accounting()
    w = torch.randn(4, 4, requires_grad=True)
    if push:
        acct.push()
    try:
        h = torch.randn(2, 4) @ w
        if case == "a saved output":  # exp saves its result
            out = h.exp()
            out.add_(1)
        elif case == "a saved input":  # mul saves its inputs
            out = h * h
            h.add_(1)
        else:  # a leaf autograd saves as it is
            leaf = torch.randn(2, 4, requires_grad=True)
            out = h * leaf
            with torch.no_grad():
                leaf.add_(1)
    finally:
        acct.pop()
    try:
        out.sum().backward()
    finally:
        assert not errors


@pytest.mark.parametrize("case", ["a saved output", "a saved input", "a saved leaf"])
def test_a_saved_tensor_changed_in_place_raises_as_it_does_untracked(case: str) -> None:
    # saved-tensor hooks turn autograd's version check off: ours repeat it
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as untracked:
        _modified_saved_tensor(False, case)
    with pytest.raises(RuntimeError, match="modified by an inplace operation") as tracked:
        _modified_saved_tensor(True, case)
    assert "is at version" in str(untracked.value) and "is at version" in str(tracked.value)


def test_popped_from_another_thread_ours_stay_and_keep_autograds_check() -> None:
    """Hooks live per thread: a pop on another thread (a detach there) cannot take ours off this
    thread's stack. Left there, they account nothing and still raise autograd's error for a saved
    tensor changed in place, as without any hooks."""
    import threading

    ledger, acct, errors = _accounting()
    assert acct.push()
    try:
        worker = threading.Thread(target=acct.pop)
        worker.start()
        worker.join()
        x = torch.ones(3, requires_grad=True)
        y = x.exp()  # saves its output
        y.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
        assert len(ledger) == 0 and not errors
    finally:
        top = torch._C._autograd._top_saved_tensors_default_hooks(True)
        if top is not None and getattr(top[0], "__self__", None) is acct:
            torch._C._autograd._pop_saved_tensors_default_hooks()


def test_pop_where_pushing_is_disabled_leaves_the_stack_to_its_owners() -> None:
    """Inside AOTAutograd's runtime or torch.func, hooks cannot be pushed: taking ours from under
    others' would lose theirs. Ours stay (accounting nothing) and theirs pop as they expect."""
    _, acct, errors = _accounting()
    top = torch._C._autograd._top_saved_tensors_default_hooks
    assert acct.push()
    try:
        with torch.autograd.graph.save_on_cpu():
            torch._C._autograd._saved_tensors_hooks_disable("disabled here", False)
            try:
                acct.pop()
            finally:
                torch._C._autograd._saved_tensors_hooks_enable()
            assert top(True) is not None and getattr(top(True)[0], "__self__", None) is not acct  # theirs, on top
        assert not errors  # and save_on_cpu's exit popped its own
    finally:
        left = top(True)
        if left is not None and getattr(left[0], "__self__", None) is acct:
            torch._C._autograd._pop_saved_tensors_default_hooks()
    assert top(True) is None
