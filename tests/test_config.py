"""Configuration validation: clear errors naming the argument and what is accepted."""

import pytest

from fsdp_mem_otel.config import ExportConfig, TrackerConfig


def test_defaults_are_light_and_valid() -> None:
    cfg = TrackerConfig()
    assert cfg.mode == "light" and cfg.deep_every == 0
    assert not any(cfg.is_deep(s) for s in range(1, 50))


def test_deep_every_marks_every_nth_step() -> None:
    cfg = TrackerConfig(deep_every=3)
    assert [s for s in range(1, 10) if cfg.is_deep(s)] == [3, 6, 9]
    assert all(TrackerConfig(mode="deep").is_deep(s) for s in range(1, 5))


@pytest.mark.parametrize(
    ("kwargs", "exc", "needle"),
    [
        ({"mode": "heavy"}, ValueError, "mode must be one of light, deep"),
        ({"deep_every": -1}, ValueError, "deep_every"),
        ({"deep_every": 1.5}, TypeError, "deep_every"),
        ({"deep_every": True}, TypeError, "deep_every"),
        ({"max_errors": "3"}, TypeError, "max_errors"),
        ({"enabled": "yes"}, TypeError, "enabled"),
        ({"reset_peaks": "yes"}, TypeError, r"reset_peaks must be a bool or None \(None: on where CUDA is"),
        ({"reset_peaks": 1}, TypeError, "reset_peaks"),
    ],
)
def test_bad_values_name_the_argument(kwargs: dict, exc: type, needle: str) -> None:
    with pytest.raises(exc, match=needle):
        TrackerConfig(**kwargs)


def test_from_env_reads_and_validates() -> None:
    cfg = TrackerConfig.from_env({"FSDP_MEM_OTEL_MODE": "deep", "FSDP_MEM_OTEL_DEEP_EVERY": "7"})
    assert cfg.mode == "deep" and cfg.deep_every == 7
    assert TrackerConfig.from_env({"FSDP_MEM_OTEL_ENABLED": "off"}).enabled is False
    with pytest.raises(ValueError, match=r"^FSDP_MEM_OTEL_DEEP_EVERY='often' is not accepted \(a whole number of "
                       r"steps >= 0; 0: never\)$"):
        TrackerConfig.from_env({"FSDP_MEM_OTEL_DEEP_EVERY": "often"})
    with pytest.raises(ValueError, match="FSDP_MEM_OTEL_ENABLED"):
        TrackerConfig.from_env({"FSDP_MEM_OTEL_ENABLED": "maybe"})
    # words in any case
    assert TrackerConfig.from_env({"FSDP_MEM_OTEL_MODE": "Deep", "FSDP_MEM_OTEL_ACTIVATIONS": "False",
                                   "FSDP_MEM_OTEL_DEEP_WHEN_COMPILED": "EAGER"}) == TrackerConfig(
        mode="deep", activations=False, deep_when_compiled="eager")
    # code wins over the environment
    assert TrackerConfig.from_env({"FSDP_MEM_OTEL_MODE": "deep"}, mode="light").mode == "light"
    with pytest.raises(TypeError, match="unknown config field 'colour'"):
        TrackerConfig.from_env({}, colour="red")


def test_reset_peaks_is_decided_where_cuda_is_unless_set() -> None:
    assert TrackerConfig().reset_peaks is None  # the tracker resolves it: on where CUDA is available
    assert TrackerConfig(reset_peaks=False).reset_peaks is False
    for raw, value in (("0", False), ("off", False), ("1", True), ("auto", None), ("AUTO", None), ("", None)):
        assert TrackerConfig.from_env({"FSDP_MEM_OTEL_RESET_PEAKS": raw}).reset_peaks is value, raw
    with pytest.raises(ValueError, match=r"FSDP_MEM_OTEL_RESET_PEAKS='sometimes' is not accepted \(1/0, .* or auto\)"):
        TrackerConfig.from_env({"FSDP_MEM_OTEL_RESET_PEAKS": "sometimes"})
    assert TrackerConfig.from_env({"FSDP_MEM_OTEL_RESET_PEAKS": "0"}, reset_peaks=None).reset_peaks is None


def test_export_config_from_env_and_validation(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fsdp_mem_otel.config import ExportConfig

    cfg = ExportConfig.from_env({
        "FSDP_MEM_OTEL_PROMETHEUS_PORT": "9500", "FSDP_MEM_OTEL_SIDECAR_DIR": "/tmp/x",
        "FSDP_MEM_OTEL_JSONL": "run-{rank}.jsonl", "FSDP_MEM_OTEL_DETAIL": "yes", "FSDP_MEM_OTEL_PROMETHEUS": "0",
    })
    assert (cfg.prometheus_port, cfg.sidecar_dir, cfg.jsonl, cfg.detail, cfg.prometheus) == \
        (9500, "/tmp/x", "run-{rank}.jsonl", True, False)
    for raw in ("http", "70000"):
        with pytest.raises(ValueError, match=f"^FSDP_MEM_OTEL_PROMETHEUS_PORT='{raw}' is not accepted \\(a port in "
                           "1..65535"):
            ExportConfig.from_env({"FSDP_MEM_OTEL_PROMETHEUS_PORT": raw})
    with pytest.raises(ValueError, match="tls_certfile and tls_keyfile go together"):
        ExportConfig(tls_certfile="a.pem")
    with pytest.raises(ValueError, match="tls_certfile: no such file"):
        ExportConfig(tls_certfile=str(tmp_path / "missing.pem"), tls_keyfile=str(tmp_path / "k.pem"))
    with pytest.raises(ValueError, match="spans_every must be an integer >= 1"):
        ExportConfig(spans_every=0)
    budgets = ExportConfig.from_env({"FSDP_MEM_OTEL_SIDECAR_INTERVAL": "0.5", "FSDP_MEM_OTEL_DETAIL_TOP_K": "3",
                                     "FSDP_MEM_OTEL_MODULE_SPANS_EVERY": "7", "FSDP_MEM_OTEL_ESTIMATE": "e.jsonl"})
    prom = budgets.prometheus_config()
    assert (prom.sidecar_interval_seconds, prom.detail_top_k, prom.estimate) == (0.5, 3, "e.jsonl")
    assert budgets.otel_config().module_spans_every == 7
    for raw in ("soon", "-5"):
        with pytest.raises(ValueError, match=f"^FSDP_MEM_OTEL_SIDECAR_INTERVAL='{raw}' is not accepted \\(a number "
                           "of seconds >= 0"):
            ExportConfig.from_env({"FSDP_MEM_OTEL_SIDECAR_INTERVAL": raw})
    with pytest.raises(ValueError, match="^FSDP_MEM_OTEL_DETAIL_TOP_K='0' is not accepted"):
        ExportConfig.from_env({"FSDP_MEM_OTEL_DETAIL_TOP_K": "0"})
    with pytest.raises(ValueError, match=r"^FSDP_MEM_OTEL_JSONL_MAX_BYTES='1GB' is not accepted \(a whole number of "
                       r"bytes, e.g. 1073741824; 0: never rotate\)$"):
        ExportConfig.from_env({"FSDP_MEM_OTEL_JSONL_MAX_BYTES": "1GB"})
    with pytest.raises(ValueError, match="^FSDP_MEM_OTEL_TLS_KEYFILE is not set \\(FSDP_MEM_OTEL_TLS_CERTFILE needs"):
        ExportConfig.from_env({"FSDP_MEM_OTEL_TLS_CERTFILE": __file__})
    with pytest.raises(ValueError, match="^FSDP_MEM_OTEL_TLS_CERTFILE='/no/such.pem' is not accepted"):
        ExportConfig.from_env({"FSDP_MEM_OTEL_TLS_CERTFILE": "/no/such.pem", "FSDP_MEM_OTEL_TLS_KEYFILE": __file__})


def test_read_env_switches_off_only_the_part_a_bad_value_configures() -> None:
    from fsdp_mem_otel.config import ENDPOINT_OFF, JSONL_OFF, SIDECAR_OFF, SPANS_OFF, ExportConfig, read_env

    good = {"FSDP_MEM_OTEL_JSONL": "run.jsonl", "FSDP_MEM_OTEL_SIDECAR_DIR": "/tmp/s", "FSDP_MEM_OTEL_MODE": "Deep"}
    settings = read_env(good)
    assert settings.bad == () and settings.tracker.mode == "deep" and not settings.quiet
    export = settings.export
    assert (export.prometheus, export.jsonl, export.sidecar_dir) == (True, "run.jsonl", "/tmp/s")
    for var, raw, off, changed in [
        ("FSDP_MEM_OTEL_JSONL_MAX_BYTES", "1GB", JSONL_OFF, {"jsonl": None}),
        ("FSDP_MEM_OTEL_JSONL_COMPRESS", "maybe", JSONL_OFF, {"jsonl": None}),
        ("FSDP_MEM_OTEL_SIDECAR_INTERVAL", "-5", SIDECAR_OFF, {"sidecar_dir": None}),
        ("FSDP_MEM_OTEL_PROMETHEUS_PORT", "0", ENDPOINT_OFF, {"prometheus": False}),
        ("FSDP_MEM_OTEL_PROMETHEUS", "sure", ENDPOINT_OFF, {"prometheus": False}),
        ("FSDP_MEM_OTEL_TLS_KEYFILE", __file__, ENDPOINT_OFF, {"prometheus": False}),
        ("FSDP_MEM_OTEL_SPANS_EVERY", "0", SPANS_OFF, {"spans": False}),
        ("FSDP_MEM_OTEL_DETAIL_TOP_K", "-1", "using the default (8)", {}),
    ]:
        settings = read_env({**good, var: raw})
        (bad,) = settings.bad
        assert bad.outcome == off and bad.line().startswith("fsdp_mem_otel: FSDP_MEM_OTEL_") and var in str(bad)
        expected = ExportConfig(**{"jsonl": "run.jsonl", "sidecar_dir": "/tmp/s", **changed})  # type: ignore[arg-type]
        assert settings.export == expected, var
        assert settings.tracker.mode == "deep" and settings.tracker.enabled
    for var, raw, field, default in [("FSDP_MEM_OTEL_MODE", "bogus", "mode", "light"),
                                     ("FSDP_MEM_OTEL_DEEP_EVERY", "x", "deep_every", 0),
                                     ("FSDP_MEM_OTEL_RESET_PEAKS", "sometimes", "reset_peaks", None)]:
        settings = read_env({var: raw})
        assert getattr(settings.tracker, field) == default and settings.tracker.enabled
        assert settings.bad[0].line().endswith(f"using the default ({'auto' if default is None else default})")
    off = read_env({"FSDP_MEM_OTEL_ENABLED": "nope", "FSDP_MEM_OTEL_JSONL_MAX_BYTES": "1GB"})
    assert not off.tracker.enabled and [b.var for b in off.bad] == ["FSDP_MEM_OTEL_ENABLED"]
    assert read_env({"FSDP_MEM_OTEL_QUIET": "Yes"}).quiet
    assert read_env({"FSDP_MEM_OTEL_QUIET": "shh"}).bad[0].outcome == "not quiet"


def test_a_jsonl_path_without_rank_gets_one_per_rank() -> None:
    from fsdp_mem_otel.config import ExportConfig

    config = ExportConfig(jsonl="/runs/run.jsonl")
    assert [config.jsonl_path(r, 2) for r in (0, 1)] == ["/runs/run.rank0.jsonl", "/runs/run.rank1.jsonl"]
    assert config.jsonl_config(1, 2).path == "/runs/run.rank1.jsonl"
    assert config.jsonl_path(0) == config.jsonl_path(0, 1) == "/runs/run.jsonl"  # one rank: the path as given
    assert ExportConfig(jsonl="/runs/run").jsonl_path(3, 4) == "/runs/run.rank3"
    assert ExportConfig(jsonl="/runs/r{rank}.jsonl").jsonl_path(3, 4) == "/runs/r3.jsonl"
    assert config.jsonl_path("{0..7}", 8) == "/runs/run.rank{0..7}.jsonl"


def test_command_line_types_name_what_they_accept() -> None:
    import argparse

    from fsdp_mem_otel.checks import int_at_least, seconds_above_zero

    port = int_at_least(0, 65535, "a port in 0..65535")
    assert port("8080") == 8080
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected a port in 0\.\.65535, got 70000"):
        port("70000")
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive integer, got 'x'"):
        int_at_least(1)("x")
    with pytest.raises(argparse.ArgumentTypeError, match="expected an integer >= 0, got -1"):
        int_at_least(0)("-1")
    assert seconds_above_zero("0.5") == 0.5
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive number of seconds, got 0.0"):
        seconds_above_zero("0")


def _env_docstrings() -> dict[str, str]:
    """env.py's constant -> the docstring written under it."""
    import ast
    import inspect

    from fsdp_mem_otel import env as env_module

    body = ast.parse(inspect.getsource(env_module)).body
    out = {}
    for stmt, doc in zip(body, body[1:], strict=False):
        if (isinstance(stmt, ast.Assign) and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)):
            out[stmt.targets[0].id] = doc.value.value  # type: ignore[attr-defined]
    return out


def test_every_default_env_py_states_is_the_code_default() -> None:
    """A variable's docstring that says "default N" (or "N (default)") says the field's default: the
    sidecar interval's once said 5 where the code used 15."""
    import re
    from dataclasses import fields

    from fsdp_mem_otel.config import EXPORT_ENV, TRACKER_ENV

    docs = _env_docstrings()
    defaults = {f.name: f.default for cls in (TrackerConfig, ExportConfig) for f in fields(cls)}
    checked = 0
    for var, spec in {**TRACKER_ENV, **EXPORT_ENV}.items():
        said = re.search(r"default (\d+(?:\.\d+)?)(?![\d.])( MiB)?|(\d+) \(default\)", docs[var])
        if said is None:
            continue
        number = float(said.group(1) or said.group(3)) * (2**20 if said.group(2) else 1)
        code = defaults[spec.field]
        assert float(code) == number, f"env.py says {var} defaults to {said.group(0)!r}; the code: {code!r}"
        checked += 1
    assert checked >= 10
