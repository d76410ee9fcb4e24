"""Light mode's activations against deep mode on the very same warmed-up step of a transformer
(HF LlamaForCausalLM from config), FSDP2 and FSDP1, with and without activation checkpointing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from torch import nn  # noqa: E402

from fsdp_mem_otel.training.tracker import FSDPMemoryTracker  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.oracles import settle  # noqa: E402

LAYERS, HIDDEN, SEQ, BATCH, VOCAB = 4, 128, 128, 4, 512


@dataclass
class ActivationRun:
    light: dict[str, Any]
    deep: dict[str, Any]
    keys: list[str]
    errors: int


def _llama(fsdp: int, checkpointing: bool) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        hidden_size=HIDDEN, intermediate_size=4 * HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=VOCAB, max_position_embeddings=SEQ))
    if checkpointing:  # HF's own: non-reentrant torch.utils.checkpoint per decoder layer
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if fsdp == 2:
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}),
                                    use_orig_params=True, device_id=torch.device("cpu"))


def light_and_deep(fsdp: int, checkpointing: bool) -> ActivationRun:
    """A light and a deep tracker on one model measure the same step (after a warm-up)."""
    rank = torch.distributed.get_rank()
    model = _llama(fsdp, checkpointing)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(rank))

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()

    step()
    settle()
    light = FSDPMemoryTracker(model, opt, mode="light").attach()
    deep = FSDPMemoryTracker(model, opt, mode="deep").attach()
    step()
    light_report, deep_report = light.step().to_dict(), deep.step().to_dict()
    deep.detach()
    light.detach()
    return ActivationRun(light_report, deep_report, light.module_keys, light.errors_total + deep.errors_total)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["no_ac", "hf_checkpointing"])
@pytest.mark.parametrize("fsdp", [1, 2])
def test_light_activations_match_deep_on_the_same_step(fsdp: int, checkpointing: bool) -> None:
    for run in run_ranks(light_and_deep, fsdp, checkpointing, timeout=600):
        assert run.errors == 0
        assert len(run.keys) == LAYERS + 1
        for key in run.keys:
            light_calls = run.light["modules"][key]["snapshots"]["after_post_forward"]
            deep_calls = run.deep["modules"][key]["snapshots"]["after_post_forward"]
            assert len(light_calls) == len(deep_calls) == 1
            ours, theirs = light_calls[0]["cpu"]["activation"], deep_calls[0]["cpu"]["activation"]
            assert theirs > 0
            assert abs(ours - theirs) <= 0.10 * theirs, (key, ours, theirs)
        if not checkpointing:  # with it, the peak is in the backward recompute, which light does not see
            ours, theirs = run.light["peak"]["cpu"]["total"], run.deep["peak"]["cpu"]["total"]
            assert abs(ours - theirs) <= 0.10 * theirs, (ours, theirs)


@dataclass
class UserHooksRun:
    user_packs: dict[str, int]  # untracked / tracked: how often the user's own pack hook ran
    losses: dict[str, list[float]]
    activation: int  # light mode's activation at the first block's after_post_forward
    errors: int


def users_saved_tensor_hooks() -> UserHooksRun:
    """The user's own saved-tensor hooks (offloading-style: pack copies) around each step: the
    tracker must chain to them, never shadow them."""
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch

    rank = torch.distributed.get_rank()
    packs: dict[str, int] = {}
    losses: dict[str, list[float]] = {}
    activation = errors = 0
    for run in ("untracked", "tracked"):
        model, opt = build(2, 32, WrapOptions(fsdp=2))
        tracker = FSDPMemoryTracker(model, opt).attach() if run == "tracked" else None
        count = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            count[0] += 1  # noqa: B023 - this run's counter
            return t.detach().clone()

        losses[run] = []
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = model(make_batch(step, 8, 32, rank)).pow(2).mean()
            loss.backward()
            opt.step()
            losses[run].append(float(loss))
            if tracker is not None:
                report = tracker.step()
                activation = report.modules["layers.0"].snapshots["after_post_forward"][0]["cpu"]["activation"]
        packs[run] = count[0]
        if tracker is not None:
            tracker.detach()
            errors = tracker.errors_total
    return UserHooksRun(packs, losses, activation, errors)


def test_users_saved_tensor_hooks_keep_running() -> None:
    for run in run_ranks(users_saved_tensor_hooks):
        assert run.errors == 0
        assert run.user_packs["untracked"] > 0
        assert run.user_packs["tracked"] == run.user_packs["untracked"]
        assert run.losses["tracked"] == run.losses["untracked"]
        assert run.activation > 0  # what their pack keeps is accounted


def loss_outside_the_model() -> list[int]:
    """A loss computed after the model (as torchtitan does): its saved tensors are seen inside
    ``tracker.saved_activations()`` and not outside it."""
    from fsdp_mem_otel.tools.demo import WrapOptions, build, make_batch

    rank = torch.distributed.get_rank()
    model, opt = build(2, 32, WrapOptions(fsdp=2))
    deltas = []
    with FSDPMemoryTracker(model, opt) as tracker:
        for scoped in (False, True):
            out = model(make_batch(0, 8, 32, rank))
            before = tracker.ledger.snapshot()["cpu"]["activation"]
            if scoped:
                with tracker.saved_activations():
                    loss = torch.log_softmax(out.repeat(1, 64), dim=-1).pow(2).mean()  # saves 8 x 2048
            else:
                loss = torch.log_softmax(out.repeat(1, 64), dim=-1).pow(2).mean()
            deltas.append(tracker.ledger.snapshot()["cpu"]["activation"] - before)
            loss.backward()
            tracker.step()
    return deltas


def test_saved_activations_scope_sees_a_loss_outside_the_model() -> None:
    saved = 8 * 32 * 64 * 4  # log_softmax's output, fp32, saved for backward (and again by pow)
    for unscoped, scoped in run_ranks(loss_outside_the_model):
        assert unscoped == 0
        assert scoped >= saved
