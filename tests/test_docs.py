"""The README and the documentation site (docs/, mkdocs.yml): they build, stay short, and say true things.

- The site builds with ``mkdocs build --strict`` and no warning at all (broken links, anchors and nav
  entries are warnings: ``validation`` in mkdocs.yml).
- README.md stays a ten-minute read: at most ``README_MAX_LINES`` lines, none over
  ``README_MAX_LINE`` characters, and a table of contents (a ``## Contents`` list linking every
  other ``##`` section).
- Every figure in README.md and docs/ is on benchmarks/README.md, verbatim: the figures live there,
  with their date and command, and the prose quotes them. A *figure* is a number with a unit of
  measurement, in prose: ``FIGURE`` matches a number (``1,024``, ``0.62``, ``~3``, ``+145.0``, a
  range ``5.7-5.9``) directly followed by ``%`` or ``x`` (a ratio: ``1.06x``), or by a time unit (``ns``,
  ``us``, ``µs``, ``ms``, ``s``) or a size unit (``B``, ``KB``, ``MB``, ``GB``, ``TB``, ``KiB``,
  ``MiB``, ``GiB``, ``TiB``, ``bytes``), with or without a space. Not figures: anything in a code
  block or an inline code span (commands, their output, settings such as ``--fit 80GiB`` or a
  default written as code, ``256 MiB``), and a number right after a word that makes it a setting
  or a bound rather than a measurement (``SETTING_WORDS``: "default 15 s", "within 2%", "more than
  10%", "at most every 15 s", "<= 20 KB"). Counts without a unit (ranks, series, steps) are not
  matched. Whitespace is compared collapsed (a figure may wrap across lines).
- Every relative link of README.md and docs/ resolves, to a file and, with ``#``, to a heading.
- The code blocks are valid: every ```python block compiles, every ```yaml block parses, and every
  ``fsdp-mem-otel COMMAND --option`` in a ```bash block names a command and options that
  ``fsdp-mem-otel COMMAND --help`` lists.
- docs/metrics.md lists exactly the metric catalog's metrics, docs/environment.md every variable
  of env.py.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
README_MAX_LINES = 300
README_MAX_LINE = 200

_NUMBER = r"\d[\d,]*(?:\.\d+)?"
_UNIT = r"(?:%|x\b|\s?(?:ns|us|µs|ms|s|B|KB|MB|GB|TB|KiB|MiB|GiB|TiB|bytes)\b)"
#: a number (or a range of two) with a unit, not inside a word or another number
FIGURE = re.compile(rf"(?<![\w.,/^~+\-])[~+\-]?{_NUMBER}(?:\s?-\s?{_NUMBER})?{_UNIT}")
#: a figure right after one of these (and optional "of"/"than"/"to"/"by") is a setting or a bound
SETTING_WORDS = re.compile(
    r"(?:\bdefault|\bdefaults to|\bwithin|\bmore than|\bless than|\bat most|\bat least|\bevery|"
    r"\bbudget|\blimit|\btarget|\bthreshold|<=|>=|<|>)\s*(?:of\s+|than\s+|to\s+|by\s+)?$",
    re.I,
)
_FENCE = re.compile(r"^```.*?^```[ \t]*$", re.S | re.M)
_INLINE_CODE = re.compile(r"`(?:[^`\n]|\n(?!\n))+`")  # may wrap, not across paragraphs
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def prose(text: str) -> str:
    """The text without code blocks and inline code spans."""
    return _INLINE_CODE.sub(" ", _FENCE.sub("\n", text))


def figures(text: str) -> list[str]:
    """The figures of ``text``, as written (see the module docstring)."""
    text = prose(text)
    found = []
    for m in FIGURE.finditer(text):
        before = text[max(0, m.start() - 40):m.start()]
        if SETTING_WORDS.search(before):
            continue
        found.append(" ".join(m.group(0).split()))
    return found


def missing_figures(text: str, page: str) -> list[str]:
    """The figures of ``text`` that ``page`` does not contain verbatim (whitespace collapsed)."""
    page = " ".join(page.split())
    return sorted({f for f in figures(text) if not re.search(rf"(?<![\d.,~]){re.escape(f)}(?![\w])", page)})


def code_blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}[ \t]*\n(.*?)^```", text, flags=re.S | re.M)


# -- the site ------------------------------------------------------------------------------------------


def test_mkdocs_build_strict_has_no_warning(tmp_path: Path) -> None:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")  # Material's notice about MkDocs 2.0 (not a warning)
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"),
         "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"mkdocs build --strict failed (pip install -e '.[docs]'):\n{output}"
    assert "WARNING" not in output, output
    assert (tmp_path / "site" / "reference" / "tracker" / "index.html").is_file()


# -- README.md -------------------------------------------------------------------------------------------


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, each space a hyphen."""
    text = re.sub(r"[`*_]", "", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def mkdocs_slug(heading: str) -> str:
    """Python-Markdown's toc anchor (mkdocs' default slugify)."""
    text = re.sub(r"[`*_]", "", heading)
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def headings(text: str, level: str = "#+") -> list[str]:
    return re.findall(rf"^{level} (.+?)\s*$", _FENCE.sub("\n", text), flags=re.M)


def test_readme_is_short_with_a_table_of_contents() -> None:
    text = README.read_text()
    lines = text.splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines (at most {README_MAX_LINES})"
    long = [(n, len(line)) for n, line in enumerate(lines, 1) if len(line) > README_MAX_LINE]
    assert not long, f"README.md lines over {README_MAX_LINE} characters (line, length): {long}"
    sections = headings(text, "##")
    assert sections and sections[0] == "Contents", "README.md: the first section is the table of contents"
    toc = text.split("## Contents", 1)[1].split("\n## ", 1)[0]
    linked = re.findall(r"^- \[[^\]]+\]\(#([^)]+)\)", toc, flags=re.M)
    assert linked == [github_slug(s) for s in sections[1:]], "README.md: the contents list every section, in order"
    assert text.index("## Contents") < len(text) // 10, "README.md: the contents are near the top"


# -- figures -------------------------------------------------------------------------------------------


def test_figure_rule() -> None:
    """What counts as a figure, and that a figure the benchmarks page lacks is reported."""
    text = (
        "takes 5.7-5.9% of the step, 1.06x, 54 s and 0.62 GB; 12 us an edge, 2.2 KiB of OTLP, 1,036 bytes\n"
        "grows +145.0 KiB/step, -0.83% off, ~300 KB a line\n"
        "the default 15 s, within 2%, more than 10%, at most every 15 s, <= 20 KB, `256 MiB`, 8 ranks, fp32\n"
        "```\npeak 507.7 KiB\n```\n"
    )
    assert figures(text) == ["5.7-5.9%", "1.06x", "54 s", "0.62 GB", "12 us", "2.2 KiB", "1,036 bytes",
                             "+145.0 KiB", "-0.83%", "~300 KB"]
    assert missing_figures("it costs 12.34 ms a step", "it costs 12.3 ms") == ["12.34 ms"]
    assert missing_figures("it costs 12.3\nms a step", "(12.3 ms)") == []
    assert missing_figures("6 ms, 25x", "6.6 ms, 1.025x") == ["25x", "6 ms"]  # a whole figure, not a tail


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_is_on_the_benchmarks_page(page: Path) -> None:
    missing = missing_figures(page.read_text(), BENCHMARKS.read_text())
    assert not missing, (
        f"{page.relative_to(ROOT)} quotes figures that benchmarks/README.md does not have: {missing} "
        "(quote the page, or write a setting as code)"
    )


# -- links -----------------------------------------------------------------------------------------------


def _anchors(path: Path) -> set[str]:
    text = path.read_text()
    slug = github_slug if path == README else mkdocs_slug
    return {slug(h) for h in headings(text)} | set(re.findall(r'id="([^"]+)"', text))


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _LINK.findall(_INLINE_CODE.sub(" ", _FENCE.sub("\n", page.read_text()))):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_docs_link_nothing_outside_docs() -> None:
    """mkdocs cannot serve files outside docs/: those are named as code (`benchmarks/README.md`)."""
    outside = []
    for page in sorted(DOCS.rglob("*.md")):
        for target in _LINK.findall(_FENCE.sub("\n", page.read_text())):
            path_part = target.partition("#")[0]
            if path_part and not re.match(r"^[a-z][a-z0-9+.-]*:", target):
                if DOCS.resolve() not in (page.parent / path_part).resolve().parents:
                    outside.append((str(page.relative_to(ROOT)), target))
    assert not outside, outside


# -- code blocks -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_and_yaml_blocks_are_valid(page: Path) -> None:
    text = page.read_text()
    for n, block in enumerate(code_blocks(text, "python")):
        compile(block, f"{page.name} python block {n}", "exec")
    for block in code_blocks(text, "yaml"):
        list(yaml.safe_load_all(block))


@functools.cache
def cli_help(command: str | None = None) -> str:
    args = [sys.executable, "-m", "fsdp_mem_otel", *([command] if command else []), "--help"]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def cli_commands() -> set[str]:
    listing = cli_help().split("commands:", 1)[1]
    return set(re.findall(r"^  ([a-z][\w-]*)\s", listing, flags=re.M))


def cli_calls(block: str) -> list[tuple[str, list[str]]]:
    """Each ``fsdp-mem-otel COMMAND`` of a bash block, with the ``--options`` it passes."""
    calls = []
    for line in block.replace("\\\n", " ").splitlines():
        tokens = shlex.split(line.replace("[", " ").replace("]", " "), comments=True)
        for i, token in enumerate(tokens):
            if token != "fsdp-mem-otel" or i + 1 >= len(tokens):
                continue
            command, options = tokens[i + 1], []
            following = tokens[i + 2:]
            for k, rest in enumerate(following):
                if rest in {"&&", ";", "||"}:
                    break
                if rest == "|" and not following[k + 1:k + 2] == [] and not following[k + 1].startswith("-"):
                    break  # a pipe; "--bytes | --json" is a usage line's alternative
                if rest.startswith("--"):
                    options.append(rest.split("=", 1)[0])
                elif command == "run" and not rest.startswith("-"):
                    break  # the script's own arguments follow
            calls.append((command, options))
    return calls


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(ROOT)))
def test_bash_blocks_call_real_commands_and_options(page: Path) -> None:
    wrong = []
    for block in code_blocks(page.read_text(), "bash"):
        for command, options in cli_calls(block):
            if command not in cli_commands():
                wrong.append(f"fsdp-mem-otel {command}: no such command")
                continue
            listed = set(re.findall(r"(?<![\w-])--[\w-]+", cli_help(command)))
            wrong += [f"fsdp-mem-otel {command} {o}: not in --help" for o in options if o not in listed]
    assert not wrong, f"{page.relative_to(ROOT)}: {wrong}"


def test_cli_call_parsing() -> None:
    assert cli_calls("fsdp-mem-otel compare a b [--rank 0] [--bytes | --json]  # note --not-this\n") == [
        ("compare", ["--rank", "--bytes", "--json"])
    ]
    block = "fsdp-mem-otel estimate --fit=4GiB \\\n    --world-size 8 && fsdp-mem-otel report x --capacity 1"
    assert cli_calls(block) == [
        ("estimate", ["--fit", "--world-size"]), ("report", ["--capacity"])
    ]
    assert cli_calls("fsdp-mem-otel run train.py --its --args") == [("run", [])]


# -- generated reference pages -------------------------------------------------------------------------------


def test_metrics_page_lists_the_catalog() -> None:
    from fsdp_mem_otel.fleet import catalog

    listed = set(re.findall(r"^\| `(fsdp_mem_\w+)` \|", (DOCS / "metrics.md").read_text(), flags=re.M))
    names = {m.name if m.name.startswith(catalog.PREFIX) else catalog.PREFIX + m.name for m in catalog.METRICS}
    assert listed == names


def test_environment_page_lists_every_variable() -> None:
    tree = ast.parse((ROOT / "fsdp_mem_otel" / "env.py").read_text())
    variables = {
        node.value.value for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    page = (DOCS / "environment.md").read_text()
    assert sorted(v for v in variables if f"`{v}`" not in page) == []
