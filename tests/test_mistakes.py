"""A new user's command-line mistakes: each is one line on stderr that names the argument (or file)
and what is accepted or what to do, a non-zero exit status and no traceback; ``--debug`` shows it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fsdp_mem_otel import cli
from fsdp_mem_otel.fleet import alerts
from tests.offline.test_report import synthetic, write_jsonl

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--world-size", "2", "--blocks", "1", "--width", "8"]  # the smallest demo-model estimate

LINEAR_MODELS = """
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def build():
    return Net()


def broken():
    raise RuntimeError("no weights here")


not_callable = 3
"""


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def one_line(err: str, out: str = "", *, progress: tuple[str, ...] = ("estimating ",)) -> str:
    """The error line of stderr: asserts there is exactly one besides progress lines, and no traceback."""
    assert "Traceback" not in err and "Traceback" not in out, err
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(progress)]
    assert len(lines) == 1, err
    return lines[0]


def unwritable(tmp_path: Path) -> Path:
    """A folder nothing can write into, root included (we run as root here, where chmod does not stop
    writes): a path under a regular file."""
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    if os.geteuid() != 0:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
        return ro
    return blocker / "sub"


# 1 -------------------------------------------------------------------------------------------
def test_estimate_with_a_batch_shape_the_model_rejects(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "estimate", *SMALL, "--batch-shape", "4,5")
    line = one_line(err, out)
    assert rc == 2 and line.startswith("fsdp-mem-otel estimate: --batch-shape 4,5 with --input-dtype float32")
    assert "normalized_shape" in line and "give a --batch-shape and --input-dtype the model takes" in line
    assert "[rank0]" not in err and out == ""


def test_estimate_end_to_end_has_no_rank_prefixed_traceback_and_debug_shows_it() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "fsdp_mem_otel.cli", "estimate", *SMALL, "--batch-shape", "4,5"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert done.returncode == 2
    line = one_line(done.stderr, done.stdout)
    assert "--batch-shape 4,5" in line and "[rank0]" not in done.stderr
    debug = subprocess.run([*cmd, "--debug"], capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert debug.returncode == 2
    assert "Traceback (most recent call last)" in debug.stderr and "[rank0]" not in debug.stderr
    assert debug.stderr.rstrip().splitlines()[-1] == line


# 2 -------------------------------------------------------------------------------------------
def test_compare_of_files_that_are_not_step_reports(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "run1.html"
    page.write_text("<html>\n" + "<p>not json</p>\n" * 5000 + "</html>\n")
    run = tmp_path / "run2.rank0.jsonl"
    write_jsonl(run, [synthetic(s, 0) for s in (1, 2, 3)])
    rc, out, err = run_cli(capsys, "compare", str(page), str(run))
    line = one_line(err, out)
    assert rc == 2 and f"{page} (A, the baseline): not a JSON-lines file of step reports" in line
    (tmp_path / "empty.jsonl").write_text("\n")
    for args, words in ((["empty.jsonl", str(run)], "empty.jsonl (A, the baseline): is empty"),
                        ([str(run), "missing.jsonl"], "missing.jsonl (B): no such file"),
                        ([str(run), str(tmp_path)], f"{tmp_path} (B): is a folder")):
        monkeypatch.chdir(tmp_path)
        rc, out, err = run_cli(capsys, "compare", *args)
        assert rc == 2 and words in one_line(err, out), err
    rc, out, err = run_cli(capsys, "report", str(page), "-o", str(tmp_path / "r.html"))
    assert rc == 2 and "(RUN.jsonl): not a JSON-lines file of step reports" in one_line(err, out)


def test_debug_shows_the_traceback(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    page = tmp_path / "run1.html"
    page.write_text("<html></html>\n")
    rc, out, err = run_cli(capsys, "compare", str(page), "--debug", str(page))
    assert rc == 2 and "Traceback (most recent call last)" in err and "UsageError" in err
    assert err.rstrip().splitlines()[-1].startswith("fsdp-mem-otel compare: ")
    rc, out, err = run_cli(capsys, "--debug", "compare", str(page), str(page))
    assert rc == 2 and "Traceback" in err


def test_an_unexpected_exception_is_one_line_naming_its_type(monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    def boom(argv: object) -> int:
        raise KeyError("surprise")

    monkeypatch.setitem(cli.COMMANDS, "rules", boom)
    rc, out, err = run_cli(capsys, "rules")
    assert rc == 1 and one_line(err, out) == ("fsdp-mem-otel rules: KeyError: 'surprise' (run again with --debug "
                                              "for the traceback)")


# 3 -------------------------------------------------------------------------------------------
def test_estimate_out_is_checked_before_the_estimate_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = unwritable(tmp_path) / "est.jsonl"
    rc, out, err = run_cli(capsys, "estimate", *SMALL, "--out", str(target))
    line = one_line(err, out)
    assert rc == 2 and line.startswith(f"fsdp-mem-otel estimate: --out {target}: ")
    assert "give a path in a folder you can write to" in line and "estimating" not in err and out == ""


def test_estimate_out_that_fails_late_still_prints_the_result(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    from fsdp_mem_otel.tools import estimate

    def fail(report: object, path: str) -> None:
        raise PermissionError(13, "Permission denied", path)

    monkeypatch.setattr(estimate, "write_jsonl", fail)
    rc, out, err = run_cli(capsys, "estimate", *SMALL, "--out", str(tmp_path / "est.jsonl"))
    line = one_line(err, out)
    assert rc == 1 and "Estimate for rank 0 of 2" in out and "total" in out
    assert line == (f"fsdp-mem-otel estimate: --out {tmp_path / 'est.jsonl'}: writing the estimate failed "
                    "(Permission denied); the estimate is printed above: give an --out in a folder you can write to")
    assert "object at 0x" not in err


def test_failure_log_says_its_failures_in_words() -> None:
    import logging

    from fsdp_mem_otel.failures import FailureLog

    log = FailureLog(logging.getLogger("test_mistakes"), "JSONL exporter")
    logging.getLogger("test_mistakes").disabled = True
    log.failed("writing", PermissionError(13, "Permission denied"), "/ro/est.jsonl")
    assert str(log) == ("JSONL exporter: 1 failure; last: writing failed (/ro/est.jsonl): PermissionError: "
                        "[Errno 13] Permission denied")
    assert "0x" not in repr(log)


# 4 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("argv", [
    ["rules", "--out", "{bad}"],
    ["rules", "--out", "{tmp}/prom", "--k8s-out", "{bad}"],
    ["dashboards", "--out", "{bad}"],
])
def test_unwritable_output_paths(argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = unwritable(tmp_path)
    run = tmp_path / "run.jsonl"
    write_jsonl(run, [synthetic(1, 0)])
    args = [a.format(bad=bad, tmp=tmp_path, run=run) for a in argv]
    rc, out, err = run_cli(capsys, *args)
    line = one_line(err, out)
    option = args[args.index(next(a for a in args if a.startswith(str(bad)))) - 1]
    assert rc == 2 and line.startswith(f"fsdp-mem-otel {args[0]}: {option} {bad}"), line
    assert "give a path in a folder you can write to" in line


def test_report_output_unwritable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run.jsonl"
    write_jsonl(run, [synthetic(1, 0)])
    bad = unwritable(tmp_path)
    with pytest.raises(SystemExit) as e:  # argparse's own error (usage, then the line), as before
        cli.main(["report", str(run), "-o", str(bad / "r.html")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "argument -o/--output: cannot create" in err and "Traceback" not in err


# 5 -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("spec", ["{mod}:build", "./{mod}.py:build", "{mod}.py:build", "{dir}/{mod}.py:build"])
def test_model_from_the_current_folder_or_a_file(spec: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    mod = f"mymodels_{abs(hash(spec)) % 10**8}"
    (tmp_path / f"{mod}.py").write_text(LINEAR_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd(), str(ROOT))] + [str(ROOT)])
    rc, out, err = run_cli(capsys, "estimate", "--model", spec.format(mod=mod, dir=tmp_path), "--batch-shape", "4,8",
                           "--world-size", "2")
    assert rc == 0, err
    assert "Estimate for rank 0 of 2" in out and "layers.0" in out


@pytest.mark.parametrize(("spec", "words"), [
    ("nosuchmodule_xyz:build", "cannot import module 'nosuchmodule_xyz'"),
    ("./nosuchfile.py:build", "no such file './nosuchfile.py'"),
    ("{mod}:nope", "has no callable 'nope'"),
    ("{mod}:not_callable", "int, not a callable, at 'not_callable'"),
    ("{mod}:broken", "calling it raised RuntimeError: no weights here"),
])
def test_model_errors_name_the_option_and_the_accepted_forms(spec: str, words: str, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    mod = f"mymodels_err_{abs(hash(spec)) % 10**8}"
    (tmp_path / f"{mod}.py").write_text(LINEAR_MODELS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    spec = spec.format(mod=mod)
    rc, out, err = run_cli(capsys, "estimate", "--model", spec, "--batch-shape", "4,8", "--world-size", "2")
    line = one_line(err, out)
    assert rc == 2 and line.startswith(f"fsdp-mem-otel estimate: --model {spec!r}: ") and words in line, line
    if "calling" not in words:
        assert "accepted: module.path:callable" in line and "path/to/file.py:callable" in line


# 6 -------------------------------------------------------------------------------------------
def test_input_dtype_the_first_layer_rejects(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "linear_first.py").write_text(LINEAR_MODELS)
    model = f"{tmp_path}/linear_first.py:build"
    rc, out, err = run_cli(capsys, "estimate", "--model", model, "--batch-shape", "4,8", "--world-size", "2",
                           "--input-dtype", "int64")
    line = one_line(err, out)
    assert rc == 2 and line.startswith("fsdp-mem-otel estimate: --input-dtype int64: the model's first layer, "
                                       "layers.0 (Linear), rejects the batch on a real forward: ")
    assert "mat1 and mat2 must have the same dtype" in line and "give the --input-dtype it takes" in line
    assert out == ""
    # what FSDP2's mixed precision casts to is accepted: bf16 inputs into bf16 parameters
    rc, out, err = run_cli(capsys, "estimate", "--model", model, "--batch-shape", "4,8", "--world-size", "2",
                           "--input-dtype", "bf16", "--param-dtype", "bf16")
    assert rc == 0, err


# 11 ------------------------------------------------------------------------------------------
def test_compare_of_a_light_run_and_a_deep_run_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    light, deep = tmp_path / "light.jsonl", tmp_path / "deep.jsonl"
    write_jsonl(light, [synthetic(s, 0, deep_every=100) for s in (1, 2)])
    write_jsonl(deep, [synthetic(3, 0, deep_every=3)])
    rc, out, err = run_cli(capsys, "compare", str(light), str(deep))
    assert rc == 0 and err == ""
    lines = out.splitlines()
    note = next(i for i, line in enumerate(lines) if line.startswith("note: "))
    assert note < lines.index("At the step peak, by category:")
    assert lines[note].startswith("note: A is light mode, B is deep mode: they put the same bytes in different "
                                  "categories") and "compare the totals and peaks, not the categories" in lines[note]
    rc, out, err = run_cli(capsys, "compare", str(deep), str(deep))
    assert rc == 0 and "note:" not in out


# 12 ------------------------------------------------------------------------------------------
def test_rules_outside_the_repository_writes_every_dashboard(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, "rules", "--out", "deploy/prometheus")
    assert rc == 0 and err == "", err
    written = (tmp_path / "deploy" / "k8s" / alerts.DASHBOARDS_FILE).read_text()
    assert written == (ROOT / "deploy" / "k8s" / alerts.DASHBOARDS_FILE).read_text()
    docs = [d for d in yaml.safe_load_all(written) if d]
    assert sorted(k for d in docs for k in d["data"]) == sorted(p.name for p in (ROOT / "dashboards").glob("*.json"))


def test_rules_with_a_dashboards_folder_holding_none(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty").mkdir()
    rc, out, err = run_cli(capsys, "rules", "--out", str(tmp_path / "prom"), "--dashboards", str(tmp_path / "empty"))
    assert rc == 2 and "wrote" not in out
    assert one_line(err) == (f"fsdp-mem-otel rules: --dashboards {tmp_path / 'empty'}: holds no *.json; give the "
                             "folder `fsdp-mem-otel dashboards --out` wrote (or leave --dashboards out to build them "
                             "from the package)")
    assert not (tmp_path / "k8s").exists() and not (tmp_path / "prom").exists()


# 13 ------------------------------------------------------------------------------------------
def test_serve_on_a_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc, out, err = run_cli(capsys, "serve", "--dir", str(tmp_path), "--port", str(port), "--addr", "127.0.0.1")
    assert rc == 1 and out == ""
    assert one_line(err) == (f"fsdp-mem-otel serve: --port {port}: 127.0.0.1:{port} is already in use; stop what "
                             "listens there or give another --port")


def test_run_help_names_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "run", "--help")
    assert rc == 0 and out.startswith("usage: fsdp-mem-otel run SCRIPT.py") and "python -m fsdp_mem_otel.run" not in out


@pytest.mark.parametrize(("argv", "line"), [
    (["run", "nothing.py"], "fsdp-mem-otel run: no such script: 'nothing.py'; give the training script's path "
                            "(or -m package.module)"),
    (["run", "--bogus"], "fsdp-mem-otel run: unknown option '--bogus'; accepted before the script: -m MODULE, "
                         "--pythonpath, --help"),
    (["run", "-m"], "fsdp-mem-otel run: -m needs a module name (as python -m: fsdp-mem-otel run -m package.module "
                    "[args])"),
])
def test_run_mistakes_are_one_line(argv: list[str], line: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    rc, out, err = run_cli(capsys, *argv)
    assert rc == 2 and out == "" and one_line(err) == line


def test_fit_probe_lines_show_the_comparison() -> None:
    from fsdp_mem_otel.tools.estimate_fit import _compared

    mib = 1 << 20
    assert _compared(int(64.02 * mib), 64 * mib) == "64.02 MiB > 64.00 MiB"
    assert _compared(int(63.99 * mib), 64 * mib) == "63.99 MiB <= 64.00 MiB"
    assert _compared(64 * mib + 1, 64 * mib) == "64.000001 MiB > 64.000000 MiB"
    assert _compared(30 * mib, 64 * mib) == "30.0 MiB <= 64.0 MiB"
    assert _compared(64 * mib, 64 * mib) == "64.0 MiB <= 64.0 MiB"


# every command's own option errors (argparse's): one line, not the usage block -----------------
HELP_HINT = "`fsdp-mem-otel {} --help` lists the options"


@pytest.mark.parametrize(("argv", "words"), [
    (["estimate", "--world-size", "0"], "argument --world-size: expected a positive integer, got 0"),
    (["serve", "--dir", "."], "the following arguments are required: --port"),
    (["report"], "the following arguments are required"),
    (["compare", "only-one.jsonl"], "the following arguments are required"),
    (["dashboards", "--bogus"], "unrecognized arguments: --bogus"),
    (["rules", "--regression-percent", "many"], "argument --regression-percent"),
])
def test_option_errors_are_one_line(argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    out, err = capsys.readouterr()
    line = one_line(err, out)
    assert exit_.value.code == 2 and "usage:" not in err and words in line, line
    assert line.startswith(f"fsdp-mem-otel {argv[0]}: ") and line.endswith(HELP_HINT.format(argv[0]))


def test_estimate_config_errors_name_the_option(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run_cli(capsys, "estimate", "--model", "tests.estimate_models:transformer")
    assert rc == 2 and one_line(err, out).startswith(
        "fsdp-mem-otel estimate: --batch-shape is required with a model of your own")
