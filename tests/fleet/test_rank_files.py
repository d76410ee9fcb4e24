"""Sidecar rank-file names are parsed strictly: no other name can pose as a rank's file."""

from __future__ import annotations

import pytest

from fsdp_mem_otel.fleet.rank_files import rank_file_name, rank_of


def test_rank_file_names_round_trip() -> None:
    for rank in (0, 1, 7, 1023):
        assert rank_of(rank_file_name(rank)) == rank


@pytest.mark.parametrize("name", ["rank-03.prom", "rank-00.prom", "rank-\u0663.prom", "rank-\uff13.prom",
                                  "rank-3.prom.tmp", ".rank-3.prom.abc.tmp", "rank--3.prom", "rank-3.PROM",
                                  "rank-.prom", "xrank-3.prom", "rank-3.prom\n"])
def test_other_names_are_no_rank(name: str) -> None:
    assert rank_of(name) is None


def test_bad_rank_is_refused() -> None:
    for bad in (-1, True, "3"):
        with pytest.raises(ValueError, match="rank"):
            rank_file_name(bad)  # type: ignore[arg-type]
