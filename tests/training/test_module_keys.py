"""One rule for module keys: the user's path, every wrapper's segment dropped (real wrappers)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fsdp_mem_otel.tools.demo import BlockModel
from fsdp_mem_otel.training.adapters.base import module_keys


def _user_keys() -> dict[str, str]:
    """The oracle: named_modules() of the unwrapped model, root named <root>."""
    return {name or "<root>": name or "<root>" for name, _ in BlockModel(2, 8).named_modules()}


def _keys_by_type(model: nn.Module) -> dict[str, type]:
    return {key: type(m) for m, key in module_keys(model).items()}


def _wrap_blocks(wrap):  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    model = BlockModel(2, 8)
    for i, block in enumerate(model.layers):
        model.layers[i] = wrap(block)
    return model


def test_plain_model_keys_are_named_modules() -> None:
    assert set(module_keys(BlockModel(2, 8)).values()) == set(_user_keys())


@pytest.mark.parametrize("wrapper", ["checkpoint_wrapper", "offload_wrapper", "torch_compile", "data_parallel"])
def test_wrapped_blocks_keep_the_users_keys(wrapper: str) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper, offload_wrapper

    wrap = {
        "checkpoint_wrapper": checkpoint_wrapper,
        "offload_wrapper": offload_wrapper,
        "torch_compile": torch.compile,  # OptimizedModule: nothing compiles until called
        "data_parallel": nn.DataParallel,  # holds the block as ``module``
    }[wrapper]
    model = _wrap_blocks(wrap)
    keys = _keys_by_type(model)
    for i in range(2):
        # the innermost module under a key is the user's block; its wrapper shares the key
        assert keys[f"layers.{i}"].__name__ == "Block"
        assert f"layers.{i}.norm" in keys and f"layers.{i}.fc1" in keys
    assert not any(seg in key for key in keys for seg in ("_checkpoint_wrapped_module", "_orig_mod", ".module"))


def test_whole_model_wrappers_make_the_model_the_root() -> None:
    model = BlockModel(2, 8)
    for top in (torch.compile(model), nn.DataParallel(model)):
        keys = module_keys(top)
        assert keys[model] == "<root>"
        assert set(keys.values()) == set(_user_keys())


def test_lightning_fabric_module_is_a_wrapper() -> None:
    fabric_wrappers = pytest.importorskip("lightning.fabric.wrappers")
    model = BlockModel(2, 8)
    wrapped = fabric_wrappers._FabricModule(model, strategy=None)
    keys = module_keys(wrapped)
    assert keys[model] == "<root>"
    assert set(keys.values()) == set(_user_keys())


def test_a_user_attribute_named_module_is_kept() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)  # the user's own name: the holder has parameters too
            self.scale = nn.Parameter(torch.ones(1))

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)
            self.other = nn.Linear(2, 2)  # a second child: not a wrapper

    assert set(module_keys(Holder()).values()) == {"<root>", "module"}
    assert set(module_keys(Two()).values()) == {"<root>", "module", "other"}
