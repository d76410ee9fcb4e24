"""Attach/detach leave FSDP exactly as they found it, and training is bitwise unchanged."""

from __future__ import annotations

import pytest

from tests import workers
from tests.dist import run_ranks


@pytest.mark.parametrize("fsdp", [1, 2])
def test_detach_restores_every_hook_and_patch(fsdp: int) -> None:
    for res in run_ranks(workers.detach_restores, {"fsdp": fsdp}):
        assert res["during"] != res["before"]  # the fingerprint does see our hooks
        assert res["after"]["light"] == res["before"]
        assert res["after"]["deep"] == res["before"]
        assert res["final"] == res["before"]
        assert res["before"]["dispatch_mode"] == "None"
        assert res["reattached"]["modules"]
        assert res["r1_modules"] == res["r1_keys"] and res["r2_modules"] == res["r2_keys"]
        assert len(res["r2_keys"]) == len(res["r1_keys"]) + 1
        assert res["errors"] == 0


@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "fsdp_inside_checkpoint"])
@pytest.mark.parametrize("fsdp", [1, 2])
def test_training_is_bitwise_unchanged(fsdp: int, checkpointed: bool) -> None:
    # fsdp_inside_checkpoint: FSDP modules recomputed in backward, where light mode's saved-tensor
    # hooks chain to checkpointing's own
    opts = {"fsdp": fsdp, "nested": True, "inner_checkpoint": True} if checkpointed else {"fsdp": fsdp}
    for res in run_ranks(workers.bitwise_unchanged, opts, 5 if checkpointed else 20):
        for variant in ("light", "deep", "deep_every"):
            assert res[variant]["losses"] == res["none"]["losses"], variant
            assert res[variant]["params"] == res["none"]["params"], variant
            assert res[variant]["errors"] == 0
