"""The README and docs/*.md as a user meets them: the examples run, the tables are what the commands print.

Three markers, each an HTML comment on the last non-blank line before what it marks:

- ``<!-- not run: reason -->`` before a ```python block that is not meant to run here (GPU-only, an
  engine's own objects); every other ```python block is executed as written, in a fresh namespace.
- ``<!-- raises: Name -->`` before a block whose point is the exception it ends with (a planted bug).
- ``<!-- generated: kvcanary zoo --markdown -->`` (or ``recall``) before a table that command prints;
  the table must be the command's output, line for line.
- ``<!-- vllm: reason -->`` before a ```python block that needs vLLM: tests/vllm/test_vllm_docs.py runs it in
  vLLM's environment (make test-vllm), not here.

The zoo plays 105 simulated runs and the recall measurement 36 (minutes on a 2-core CPU), so the default
run regenerates the rows of a few cheap bugs and the table's shape; ``-m slow`` compares whole tables.
"""

from __future__ import annotations

import builtins
import pathlib
import re

import pytest

import kvcanary

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKER = re.compile(r"<!--\s*(not run|raises|generated|vllm):\s*(.+?)\s*-->\s*$")
MAX_NOT_RUN = 6  # blocks exempt from running stay the exception: a new one needs a reason and room here
FAST_BUGS = ["spec_keep_rejected", "swa_no_translation"]  # 3 simulated runs, seconds on the CPU


def _marker(lines: list[str], i: int) -> tuple[str, str] | None:
    """The marker on the last non-blank line before line ``i``, if any."""
    j = i - 1
    while j >= 0 and not lines[j].strip():
        j -= 1
    m = MARKER.search(lines[j]) if j >= 0 else None
    return (m.group(1), m.group(2)) if m else None


def python_blocks() -> list[tuple[str, int, str, tuple[str, str] | None]]:
    """(file, line of the fence, code, marker) for every ```python block of the docs."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() == "```python":
                end = next(k for k in range(i + 1, len(lines)) if lines[k].strip() == "```")
                out.append((path.relative_to(ROOT).as_posix(), i + 1, "\n".join(lines[i + 1:end]) + "\n",
                            _marker(lines, i)))
                i = end
            i += 1
    return out


def generated_tables(command: str) -> list[tuple[str, list[str]]]:
    """(file, table lines) for every table the docs mark as printed by ``command``."""
    out = []
    for path in DOCS:
        lines = path.read_text().splitlines()
        for i, line in enumerate(lines):
            if line.lstrip().startswith("|") and (i == 0 or not lines[i - 1].lstrip().startswith("|")):
                if _marker(lines, i) == ("generated", command):
                    end = next((k for k in range(i, len(lines)) if not lines[k].lstrip().startswith("|")),
                               len(lines))
                    out.append((path.relative_to(ROOT).as_posix(), [x.strip() for x in lines[i:end]]))
    return out


BLOCKS = python_blocks()
RUN = [b for b in BLOCKS if b[3] is None or b[3][0] == "raises"]


@pytest.mark.parametrize("where, line, code, marker", RUN, ids=[f"{b[0]}:{b[1]}" for b in RUN])
def test_python_example_runs_as_written(where, line, code, marker):
    scope: dict = {"__name__": "__doc_example__"}
    compiled = compile(code, f"{where}:{line}", "exec")
    if marker is None:
        exec(compiled, scope)
        return
    expected = getattr(kvcanary, marker[1], None) or getattr(builtins, marker[1], None)
    assert isinstance(expected, type) and issubclass(expected, BaseException), \
        f"{where}:{line}: raises marker names {marker[1]!r}, not an exception of kvcanary or builtins"
    with pytest.raises(expected):
        exec(compiled, scope)


def test_blocks_not_run_are_few_and_say_why():
    skipped = [(b[0], b[1], b[3][1]) for b in BLOCKS if b[3] is not None and b[3][0] == "not run"]
    assert len(skipped) <= MAX_NOT_RUN, skipped
    assert all(len(reason) >= 10 for _, _, reason in skipped), skipped
    assert len(RUN) >= 4  # the README's attach snippet, the runtime example, configuration, transformers


def test_every_results_path_the_docs_cite_exists():
    cited = {(p.relative_to(ROOT).as_posix(), m.group(0).rstrip(".,;:)`'"))
             for p in DOCS for m in re.finditer(r"docs/(?:results|img)/[\w./{},*-]*", p.read_text())}
    missing = []
    for where, ref in sorted(cited):
        # docs/results/x/matrix_{a,b,c}.* names a family of files: it exists when the folder holds one.
        base = ref.split("{")[0].split("*")[0].rstrip("._")
        if not list(ROOT.glob(base + "*")):
            missing.append((where, ref))
    assert not missing, f"cited but not in the tree (removed results live in git history): {missing}"


def test_results_hold_only_what_current_figures_need():
    files = [p for p in (ROOT / "docs" / "results").rglob("*") if p.is_file()]
    assert 0 < len(files) <= 30, len(files)


def _zoo_tables() -> list[tuple[str, list[str]]]:
    tables = generated_tables("kvcanary zoo --markdown")
    assert tables, "the README shows the zoo table under <!-- generated: kvcanary zoo --markdown -->"
    return tables


@pytest.fixture(scope="module")
def fast_zoo():
    """The zoo's runs of ``FAST_BUGS`` in every configuration where they apply, once for this module."""
    from kvcanary.sim.zoo import run_zoo

    return run_zoo(FAST_BUGS, clean=False)


def test_zoo_table_rows_are_what_the_command_prints(fast_zoo):
    from kvcanary.sim.bugs import BUGS
    from kvcanary.sim.zoo import format_markdown

    fresh = format_markdown(fast_zoo).splitlines()
    for where, table in _zoo_tables():
        assert table[:2] == fresh[:2], f"{where}: the zoo table's header differs from the command's"
        names = [row.split("|")[1].strip().strip("`") for row in table[2:]]
        assert names == ["(clean)", *BUGS], f"{where}: the zoo table's rows are not one per bug in registry order"
        for row in fresh[2:]:
            assert row in table, f"{where}: the row differs from `kvcanary zoo --markdown`:\n{row}"


@pytest.mark.slow
def test_zoo_table_is_what_the_command_prints():
    from kvcanary.sim.zoo import format_markdown, run_zoo

    fresh = format_markdown(run_zoo()).splitlines()
    for where, table in _zoo_tables():
        assert table == fresh, where


@pytest.mark.slow
def test_recall_table_is_what_the_command_prints(capsys):
    from kvcanary import cli

    tables = generated_tables("kvcanary recall --markdown")
    assert tables
    assert cli.main(["recall", "--markdown"]) == 0
    fresh = [x for x in capsys.readouterr().out.splitlines() if x.startswith("|")]
    for where, table in tables:
        assert table == fresh, where


def test_markdown_options_print_markdown(capsys, monkeypatch, fast_zoo):
    from kvcanary import cli
    from kvcanary.sim import zoo

    # The command's own runs are the fixture's (already played): this checks what --markdown prints.
    monkeypatch.setattr(zoo, "run_zoo", lambda bugs, *a, **k: fast_zoo if bugs == FAST_BUGS else None)
    assert cli.main(["zoo", "--markdown", *(x for b in FAST_BUGS for x in ("--bug", b))]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == zoo.format_markdown(fast_zoo).splitlines()
    assert out[0].startswith("| bug | class |") and out[1].startswith("|---|")
    assert [x.split("|")[1].strip() for x in out[2:]] == [f"`{b}`" for b in FAST_BUGS]
    assert cli.main(["recall", "--markdown", "--configs", "base", "--kinds", "kv", "--prob", "0.5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("| run | injections |") and out[2].startswith("| kv |")
    assert cli.main(["zoo", "--markdown", "--distributed"]) == 2
    assert "--markdown applies to the simulated engine's zoo" in capsys.readouterr().err


def test_readme_is_an_entry_point():
    """At most 200 lines, its sections in the order a newcomer reads them, attach on the first screen."""
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    heads = [x[3:] for x in lines if x.startswith("## ")]
    order = ["Install", "Attach it", "In an engine's tests: the pytest fixture", "The command line",
             "What it catches", "What it costs", "Layout", "Documentation"]
    assert heads == order, heads
    assert next(i for i, x in enumerate(lines) if "import attach" in x) < 60
    costs = "\n".join(lines[lines.index("## What it costs"):lines.index("## Layout")])
    # the user's price comes first: whole generations against the engine's fastest configuration
    assert costs.index("fastest configuration") < costs.index("Per step")
