"""The documentation renders and runs as written.

- Every code fence of the pages (README.md, docs/*.md, docs/results/*.md) closes on a line of its own (a
  fence closed with text after it renders everything below it as one code block), and none is left open.
- No unfilled placeholder (such as LIVE0P5B for a number still to be measured).
- docs/method.md is the project's spec, ../shared/METHOD.md, byte for byte (where the checkout has it).
- Every ```python block runs as written (`e2e`): the blocks of a page in order, in one namespace, in a
  fresh folder that has the repository's `configs/`, with the tiny models the blocks build themselves. A
  block that cannot run offline is marked by the line `<!-- not run: <reason> -->` right above its fence;
  there must be few.
- Every ``ict-jax`` command of a ```bash block parses with the command line's own parser (required flags,
  choices, types).
- Every ```bash block marked runnable runs as written (bash -e, in a fresh folder that has the
  repository's `configs/`): the line `<!-- run -->` right above its fence (the default suite: seconds, a
  tiny model) or `<!-- run: slow -->` (marked `slow`: minutes).
- Every relative link of the pages names a file that exists.
- Every result table of docs/results.md and docs/results/*.md names its record, or is marked historical.
- Every experiment report committed under docs/experiments/ is its record's, rebuilt unchanged.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "results").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*(?P<reason>\S.*?)\s*-->")
MAX_NOT_RUN = 3
_OPEN = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>.*)$")


def fenced_blocks(text: str) -> tuple[list[dict], list[str]]:
    """CommonMark code fences: ([{"line", "info", "code", "closed"}], problems). A fence closes on a line of
    the same character, at least as long, followed by nothing but spaces; inside a block, a line that
    starts like a closing fence but has text after it is reported (the author meant to close there)."""
    blocks, problems = [], []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        m = _OPEN.match(lines[i])
        if not m or (m["fence"][0] == "`" and "`" in m["info"]):
            i += 1
            continue
        char, size, start = m["fence"][0], len(m["fence"]), i
        body, closed = [], False
        i += 1
        while i < len(lines):
            line = lines[i]
            close = re.match(rf"^ {{0,3}}{re.escape(char)}{{{size},}}(?P<rest>.*)$", line)
            if close and not close["rest"].strip():
                closed = True
                break
            if close:
                problems.append(f"line {i + 1}: text after a closing fence ({line.strip()[:40]!r}): the block opened "
                                f"at line {start + 1} does not close here")
            body.append(line)
            i += 1
        if not closed:
            problems.append(f"line {start + 1}: a code fence that never closes")
        blocks.append({"line": start + 1, "info": m["info"].strip(), "code": "\n".join(body), "closed": closed,
                       "before": lines[start - 1] if start else ""})
        i += 1
    return blocks, problems


def test_the_fence_reader_on_hand_cases():
    ok, problems = fenced_blocks("a\n```python\nx = 1\n```\n\n~~~\n```\n~~~\n")
    assert problems == [] and [(b["line"], b["info"], b["code"]) for b in ok] == [(2, "python", "x = 1"), (6, "", "```")]
    _, problems = fenced_blocks("```\ntable\n``` Its task is\nmore\n")  # README line 39
    assert problems == ["line 3: text after a closing fence ('``` Its task is'): the block opened at line 1 does "
                        "not close here", "line 1: a code fence that never closes"]
    _, problems = fenced_blocks("````\n```\n````\n")  # a shorter fence inside a longer one is text
    assert problems == []


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_fence_closes_on_its_own_line(page):
    _, problems = fenced_blocks(page.read_text())
    assert not problems, f"{page.name}: " + "; ".join(problems)


_MD_LINK = re.compile(r"\]\((?P<target>[^)\s]+)\)")


def broken_links(text: str, page_dir: Path) -> list[str]:
    """The relative Markdown links of ``text`` (outside code fences and code spans) whose file does not
    exist, relative to ``page_dir``. A web address, a bare ``#anchor`` and a target with neither ``.`` nor
    ``/`` (the spec's ``p[i,t](o_{i,t})`` is a formula, not a link) are not checked."""
    lines, inside = [], None
    for line in text.split("\n"):
        m = re.match(r"^ {0,3}(`{3,}|~{3,})", line)
        if m and inside is None:
            inside = m[1]
        elif m and inside is not None and m[1][0] == inside[0] and len(m[1]) >= len(inside):
            inside = None
        elif inside is None:
            lines.append(re.sub(r"`[^`]*`", "", line))
    bad = []
    for m in _MD_LINK.finditer("\n".join(lines)):
        target = m["target"].split("#")[0]
        if not target or re.match(r"[A-Za-z][\w+.-]*:", target) or not re.search(r"[./]", target):
            continue
        if not (page_dir / target).exists():
            bad.append(m["target"])
    return bad


def test_the_link_check_on_hand_cases(tmp_path):
    (tmp_path / "a.md").write_text("")
    text = ("[a](a.md) [b](b.md#x) [w](https://x.org/y.md) [s](#top) p[i,t](o_{i,t})\n`[c](c.md)`\n"
            "```\n[d](d.md)\n```\n[e](sub/e.json)\n")
    assert broken_links(text, tmp_path) == ["b.md#x", "sub/e.json"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    bad = broken_links(page.read_text(), page.parent)
    assert not bad, f"{page.name}: links to files that do not exist: {bad}"


# Capitalised words of the docs that are neither names in the code nor ordinary terms are unfilled
# placeholders (LIVE0P5B). The terms below are words of the text, not names the code defines.
TERMS = {"AIME_2024", "CHANGELOG", "CONFIG", "DESIGN", "FILE", "GEMM", "HOST", "MATH500", "METHOD", "OCDBT", "PORT", "STREAM_ID",
         "TF32", "ZONE"}


def _code_words() -> set[str]:
    words: set[str] = set()
    for folder in ("ict_jax", "tests", "configs", "notebooks", "benchmarks", ".ci"):
        for f in (ROOT / folder).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".yaml", "", ".sh") and f.name != "test_docs.py":
                words |= set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", f.read_text(errors="replace")))
    return words | set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", (ROOT / "pyproject.toml").read_text()))


def test_no_unfilled_placeholders():
    known = _code_words() | TERMS
    bad = {}
    for page in PAGES:
        text = page.read_text()
        words = set(re.findall(r"\b[A-Z][A-Z0-9_]{3,}\b", text)) - known
        words |= set(re.findall(r"\b(?:TODO|TBD|FIXME|XXX)\b|\{\{[^}]*\}\}", text))
        if words:
            bad[page.name] = sorted(words)
    assert not bad, f"placeholders (or words to add to TERMS): {bad}"


def python_blocks(page: Path) -> list[dict]:
    blocks, _ = fenced_blocks(page.read_text())
    out = []
    for b in blocks:
        if b["info"].split()[:1] == ["python"]:
            m = NOT_RUN.search(b["before"])
            out.append({**b, "skip": m["reason"] if m else None})
    return out


def test_method_md_is_the_shared_spec():
    """docs/method.md is a copy of the project's METHOD.md (the spec the code cites), kept identical: the
    companion pages (loss.md, statistics.md, results.md) say what the code does beside it."""
    spec = ROOT.parent / "shared" / "METHOD.md"
    if not spec.is_file():
        pytest.skip(f"no {spec} beside this checkout")
    assert (ROOT / "docs" / "method.md").read_bytes() == spec.read_bytes(), \
        "docs/method.md differs from ../shared/METHOD.md: copy the spec over"


def test_few_blocks_are_not_run_and_each_says_why():
    skipped = [(p.name, b["line"], b["skip"]) for p in PAGES for b in python_blocks(p) if b["skip"] is not None]
    assert len(skipped) <= MAX_NOT_RUN, skipped
    assert all(len(reason) >= 10 for _, _, reason in skipped), skipped


@pytest.mark.e2e  # every ```python block of the docs, run: about a minute on 2 cores
@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p)], ids=lambda p: p.name)
def test_every_python_block_runs_as_written(page, tmp_path, monkeypatch, capsys):
    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__main__"}
    for block in python_blocks(page):
        if block["skip"] is not None:
            continue
        code = compile(block["code"], f"{page.name}, the block at line {block['line']}", "exec")
        exec(code, namespace)  # noqa: S102 - the documentation's own examples
        out = capsys.readouterr().out
        assert not signed_zeros(out), f"{page.name}, the block at line {block['line']} prints a signed zero: {out}"
    assert os.getcwd() == str(tmp_path)


def signed_zeros(text: str) -> list[str]:
    """The numbers ``-0``, ``-0.0``, ``-0.0000`` ... in ``text``: a rounded -0.0 a snippet prints."""
    return [m.group(0) for m in re.finditer(r"(?<![\w.])-0(?:\.0+)?(?![\d.])", text)]


def test_signed_zeros_on_hand_cases():
    assert signed_zeros("loss -0.0000, selected 0.167; x -0 y -0.0") == ["-0.0000", "-0", "-0.0"]
    assert signed_zeros("loss 0.0000, -0.0012, -0.5, 1-0.0 is a range, -0.01e-3, a-0") == []


# ------------------------------------------------------------------------------------------------
# Shell commands: every documented `ict-jax` command parses; the blocks marked runnable run
# ------------------------------------------------------------------------------------------------
RUN = re.compile(r"<!--\s*run(?::\s*(?P<kind>slow))?\s*-->")
SHELL = {"bash", "sh", "shell"}


def shell_blocks(page: Path) -> list[dict]:
    """The ```bash blocks of a page, each with ``run``: None (not run), "default" or "slow"."""
    blocks, _ = fenced_blocks(page.read_text())
    out = []
    for b in blocks:
        if b["info"].split()[:1] and b["info"].split()[0] in SHELL:
            m = RUN.search(b["before"])
            out.append({**b, "run": None if m is None else (m["kind"] or "default")})
    return out


def shell_commands(code: str) -> list[str]:
    """The ``ict-jax ...`` commands of a shell block: continuation lines joined, split at ``&&``, ``||``,
    ``;`` and ``|``, leading ``VAR=value`` assignments and ``nice -n N`` dropped; a command that reads a
    shell variable (``$s``) is left out (its value is not known here)."""
    import shlex

    text = code.replace("\\\n", " ")
    found = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words = list(lexer)  # `#` comments dropped; `&&`, `;`, `|` their own words
        segment: list[str] = []
        for w in [*words, "&&"]:
            if w in ("&&", "||", ";", "|"):
                while segment and (re.fullmatch(r"[A-Za-z_]\w*=.*", segment[0]) or segment[0] == "nice"):
                    segment = segment[3:] if segment[0] == "nice" else segment[1:]
                if segment[:1] == ["ict-jax"] and not any("$" in x for x in segment):
                    found.append(shlex.join(segment))
                segment = []
            else:
                segment.append(w)
    return found


def documented_commands() -> list[tuple[str, str]]:
    """(where, command) of every ``ict-jax`` command in a bash block (a code span names a command's form or
    one of its flags, not a whole command)."""
    return [(f"{page.name}:{b['line']}", c) for page in PAGES for b in shell_blocks(page)
            for c in shell_commands(b["code"])]


def test_the_shell_command_reader_on_hand_cases():
    code = ("pip install x && ict-jax info   # a comment\nICT_X=1 nice -n 5 ict-jax eval --model m \\\n"
            "    --n 2; rc=$?\nfor s in 0 1; do ict-jax sample --seed $s; done\n")
    assert shell_commands(code) == ["ict-jax info", "ict-jax eval --model m --n 2"], shell_commands(code)


def test_every_documented_command_parses():
    import contextlib
    import io
    import shlex

    from ict_jax.cli.main import build_parser, join_negative_values

    parser = build_parser()
    commands = documented_commands()
    assert len(commands) > 20, commands  # the reader found the docs' commands
    bad = []
    for where, command in commands:
        argv = join_negative_values(shlex.split(command)[1:])
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args, extra = parser.parse_known_args(argv)
        except SystemExit:
            bad.append(f"{where}: {command!r}: {err.getvalue().strip().splitlines()[-1:]}")
            continue
        if [e for e in extra if "=" not in e or e.startswith("-")] or (extra and not hasattr(args, "overrides")):
            bad.append(f"{where}: {command!r}: unrecognized {extra}")
    assert not bad, "documented commands the command line refuses:\n" + "\n".join(bad)


RUNNABLE = [(p, b) for p in PAGES for b in shell_blocks(p) if b["run"] is not None]


def _unique_blocks(blocks: list[tuple[Path, dict]]) -> list[tuple[Path, dict]]:
    """One of each block text (the first page's), so a quickstart that two pages show runs once: the same
    commands in the same empty folder."""
    seen: dict[tuple[str, str], tuple[Path, dict]] = {}
    for page, block in blocks:
        seen.setdefault((block["code"], block["run"]), (page, block))
    return list(seen.values())


def test_runnable_blocks_are_marked():
    assert RUNNABLE and {b["run"] for _, b in RUNNABLE} <= {"default", "slow"}
    a, b = {"code": "ict-jax info\n", "run": "default", "line": 3}, {"code": "ict-jax info\n", "run": "default", "line": 9}
    c = {"code": "ict-jax info\n", "run": "slow", "line": 4}
    assert _unique_blocks([(Path("README.md"), a), (Path("cli.md"), b), (Path("x.md"), c)]) == [
        (Path("README.md"), a), (Path("x.md"), c)]


@pytest.mark.parametrize("page, block", [pytest.param(p, b, id=f"{p.name}:{b['line']}",
                                                      marks=[pytest.mark.slow] if b["run"] == "slow" else [])
                                         for p, b in _unique_blocks(RUNNABLE)])
def test_every_runnable_shell_block_runs_as_written(page, block, tmp_path):
    import subprocess

    (tmp_path / "configs").symlink_to(ROOT / "configs", target_is_directory=True)
    # a default block runs for seconds: the tests' compile flags (tests/conftest.py); a slow one for minutes, at
    # XLA's defaults, as a user runs it (the demo plan: 517 s with the tests' flags, 383 s at the defaults)
    flags = os.environ["ICT_JAX_TEST_SUBPROCESS_XLA_FLAGS"] if block["run"] == "default" else ""
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    r = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block["code"]], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, f"{page.name}, the block at line {block['line']}:\n{r.stdout[-2000:]}{r.stderr[-3000:]}"


# ------------------------------------------------------------------------------------------------
# Install lines: every extra a page, a config, a message or CI names exists, spelled as pip matches it
# ------------------------------------------------------------------------------------------------
def _extras() -> dict[str, list[str]]:
    import tomllib

    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]


def normal_extra(name: str) -> str:
    """The normal form of an extra's name (PEP 685): lowercase, runs of ``-_.`` written as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


#: ``pip install 'ict_jax[a,b]'`` / ``pip install -e ".[a,b]"``: the extras named
_INSTALL_EXTRAS = re.compile(r"""(?:ict_jax|ict-jax|["']\.)\[(?P<extras>[^\]{}'"]+)\]""")


def documented_extras() -> dict[str, list[str]]:
    """{extra name as written: [where]} of every install line in the pages, configs, library messages,
    benchmarks and CI (not the tests, whose fake models name fake extras)."""
    files = [*PAGES, ROOT / ".ci" / "run"]
    for folder, pattern in (("configs", "*.yaml"), ("ict_jax", "*.py"), ("benchmarks", "*.py"), ("notebooks", "*.py")):
        files += sorted((ROOT / folder).rglob(pattern))
    found: dict[str, list[str]] = {}
    for f in files:
        if not f.is_file():
            continue
        for i, line in enumerate(f.read_text(errors="replace").splitlines(), 1):
            for m in _INSTALL_EXTRAS.finditer(line):
                for name in m["extras"].split(","):
                    found.setdefault(name.strip(), []).append(f"{f.relative_to(ROOT)}:{i}")
    return found


def test_extras_are_named_in_normal_form():
    """pip 23.2 (a fresh Python 3.11 venv's) matches the extra a user types literally against the metadata,
    where setuptools writes the normal form: an extra named otherwise installs nothing."""
    names = list(_extras())
    assert names and all(n == normal_extra(n) for n in names), [n for n in names if n != normal_extra(n)]


def test_every_documented_install_line_names_an_existing_extra():
    from ict_jax.model.packaged import KNOWN_MODELS

    extras = set(_extras())
    found = documented_extras()
    assert {"qwen2-5-coder-0-5b", "test", "tpu", "wandb"} <= set(found), found  # the scan reads the lines
    bad = {name: where for name, where in found.items() if name not in extras}
    assert not bad, f"install lines naming no extra of pyproject.toml (spelled otherwise?): {bad}"
    # `ict-jax info`'s hint and the missing-part message name the model's extra
    assert all(m.extra in extras for m in KNOWN_MODELS.values()), [m.extra for m in KNOWN_MODELS.values()]


def _wheel_of_the_metadata(out: Path) -> Path:
    """A wheel holding only this checkout's metadata as setuptools writes it (the extras' requirements, no
    base requirements): what pip reads to resolve ``ict_jax[extra]``."""
    import subprocess
    import sys
    import zipfile

    meta = out / "meta"
    meta.mkdir()
    subprocess.run([sys.executable, "-c", "import sys; from setuptools.build_meta import "
                    "prepare_metadata_for_build_wheel as p; p(sys.argv[1])", str(meta)],
                   cwd=ROOT, check=True, capture_output=True)
    info = next(meta.glob("*.dist-info"))
    lines = [ln for ln in (info / "METADATA").read_text().splitlines()
             if not (ln.startswith("Requires-Dist:") and "extra ==" not in ln)]
    wheel = out / "wheels" / f"{info.name[:-len('.dist-info')]}-py3-none-any.whl"
    wheel.parent.mkdir()
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr(f"{info.name}/METADATA", "\n".join(lines) + "\n")
        z.writestr(f"{info.name}/WHEEL", "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
                                          "Tag: py3-none-any\n")
        z.writestr(f"{info.name}/RECORD", "")
    return wheel.parent


@pytest.mark.e2e  # a fresh venv and a pip subprocess an extra (~25 s)
def test_a_fresh_venvs_pip_resolves_every_documented_extra(tmp_path):
    """The pip that ``python -m venv`` brings (23.2 with Python 3.11: it does not normalise the name typed)
    resolves each documented extra to its requirements: offline, the first of them is the one it cannot
    find; an extra it does not know would be a warning and "Would install ict_jax" alone. pip runs outside the
    checkout and without the tests' PYTHONPATH: on its path, an editable install's ict_jax.egg-info in the
    checkout would read as ict_jax already installed, with every base requirement."""
    import subprocess
    import sys

    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"python -m venv failed here: {made.stderr.strip()[-200:]}")
    wheels = _wheel_of_the_metadata(tmp_path)
    extras = _extras()
    # no PIP_* settings, and no PYTHONPATH: conftest puts the checkout on it for the CLI's subprocesses
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    for name in sorted(documented_extras()):
        r = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "--isolated", "install", "--dry-run",
                            "--no-index", "--find-links", str(wheels), f"ict_jax[{name}]"],
                           capture_output=True, text=True, env=env, cwd=tmp_path)
        out = r.stdout + r.stderr
        assert "does not provide the extra" not in out, out
        first = re.split(r"[=<>\[;! ]", extras[name][0])[0]
        assert r.returncode != 0 and f"No matching distribution found for {first}" in out, (name, out)


# ------------------------------------------------------------------------------------------------
# Every result table of docs/results.md (and of its pages under docs/results/) names its record and a
# reproducing command, or is marked historical with the commit it was measured at
# ------------------------------------------------------------------------------------------------
RESULTS = ROOT / "docs" / "results.md"
#: results.md and its pages under docs/results/ (the measurements of a superseded setting, kept by topic)
RESULT_PAGES = [RESULTS, *sorted((ROOT / "docs" / "results").glob("*.md"))]
#: the first header cell of a table that documents a command's options or outputs: it holds no result
REFERENCE_TABLES = {"option", "key", "column"}
_TABLE_ROW = re.compile(r"^\s{0,3}\|")
_TABLE_RULE = re.compile(r"^\s{0,3}\|?\s*:?-{3,}:?\s*(\|\s*:?-{3,}:?\s*)*\|?\s*$")
_HEADING = re.compile(r"^#{1,6}\s")
_MARK = re.compile(r"^(?:\*\*|\*|_)?(?P<kind>Records?|Historical):")
_MEASURED = re.compile(r"measured at commit (?P<commit>[0-9a-f]{7,40}) \((?P<date>\d{4}-\d{2}-\d{2})\)")
_COMMIT_DATE = re.compile(r"\bcommit (?P<commit>[0-9a-f]{7,40}) \((?P<date>\d{4}-\d{2}-\d{2})\)")
_LINK = re.compile(r"\]\((?P<target>[^)\s#]+)(?:#[^)\s]*)?\)")
_COMMAND_SPAN = re.compile(r"`(?:ict-jax|python) [^`]+`")
_REPRODUCE = re.compile(r"\breproduce(?: [^:.;]{1,40})?:")
RECORD_SUFFIXES = (".json", ".jsonl", ".md")


def _commit_date(commit: str) -> str | None:
    """The commit's date (YYYY-MM-DD) in this checkout's git history; None where git cannot say (no git,
    a shallow clone): then the commits are not checked."""
    import subprocess

    try:
        shallow = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--is-shallow-repository"],
                                 capture_output=True, text=True, timeout=30)
        if shallow.returncode != 0 or shallow.stdout.strip() != "false":
            return None
        r = subprocess.run(["git", "-C", str(ROOT), "log", "-1", "--format=%ad", "--date=short", f"{commit}^{{commit}}"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else "unknown commit"


def result_table_problems(text: str, page_dir: Path, commit_date=_commit_date) -> list[str]:
    """Each result table must be followed, before the next table or heading, by a paragraph that starts
    ``Record:`` (or ``Records:``) or ``Historical:``.

    - A record names at least one existing record file by a Markdown link (``.json``, ``.jsonl``, or a
      ``.md`` report; relative to the page) and how to reproduce it: ``reproduce:`` (or ``reproduce the
      ... rows:``) followed by a command in a code span (`` `ict-jax ...` `` or `` `python ...` ``), or by
      "the [first, second, ...] command(s) above" where the section shows such a command in a code block
      before the table.
    - A historical mark says ``measured at commit <hash> (<YYYY-MM-DD>)``, ``no record kept`` and ``the
      command of that time``.
    - Every ``commit <hash> (<date>)`` in a mark names a commit of this history with that date
      (where git can tell). Tables whose first header cell is one of :data:`REFERENCE_TABLES` document a
      command and need no mark. Returns the problems, one line each."""
    lines = text.split("\n")
    problems: list[str] = []
    in_fence, section_start, code_lines = False, 0, []  # code_lines: (line index, text) of code blocks
    i = 0
    while i < len(lines):
        line = lines[i]
        if re.match(r"^ {0,3}(`{3,}|~{3,})", line):
            in_fence = not in_fence
            i += 1
            continue
        if in_fence or line.startswith("    "):
            code_lines.append((i, line))
            i += 1
            continue
        if _HEADING.match(line):
            section_start = i
            i += 1
            continue
        if not (_TABLE_ROW.match(line) and i + 1 < len(lines) and _TABLE_RULE.match(lines[i + 1])):
            i += 1
            continue
        start, header = i, line.strip().strip("|").split("|")[0].strip().lower()
        while i < len(lines) and _TABLE_ROW.match(lines[i]):
            i += 1
        if header in REFERENCE_TABLES:
            continue
        # the paragraphs between the table's end and the next table or heading
        j, paragraphs, current = i, [], []
        while j < len(lines) and not _HEADING.match(lines[j]) and not (
                _TABLE_ROW.match(lines[j]) and j + 1 < len(lines) and _TABLE_RULE.match(lines[j + 1])):
            if lines[j].strip():
                current.append(lines[j].strip())
            elif current:
                paragraphs.append(" ".join(current))
                current = []
            j += 1
        if current:
            paragraphs.append(" ".join(current))
        marks = [p for p in paragraphs if _MARK.match(p)]
        where = f"the table at line {start + 1} ({lines[start].strip()[:50]}...)"
        if not marks:
            problems.append(f"{where}: no 'Record:' or 'Historical:' paragraph after it")
            continue
        for mark in marks:
            for m in _COMMIT_DATE.finditer(mark):
                date = commit_date(m["commit"])
                if date is not None and date != m["date"]:
                    problems.append(f"{where}: commit {m['commit']} is dated {date}, not {m['date']}")
            if _MARK.match(mark)["kind"] == "Historical":
                missing = [s for s in ("measured at commit", "no record kept", "the command of that time")
                           if s not in mark]
                if missing or not _MEASURED.search(mark):
                    problems.append(f"{where}: a historical mark says 'measured at commit <hash> (<date>)', "
                                    f"'no record kept' and 'the command of that time' (missing: {missing})")
                continue
            records = [t for t in (m["target"] for m in _LINK.finditer(mark)) if t.endswith(RECORD_SUFFIXES)]
            missing = [t for t in records if not (page_dir / t).is_file()]
            if not records or missing:
                problems.append(f"{where}: its record links no existing record file ({missing or 'no link'})")
            command = _REPRODUCE.search(mark)
            above = any(re.search(r"\b(ict-jax|python) ", code) for k, code in code_lines if section_start < k < start)
            if command is None or not (_COMMAND_SPAN.search(mark, command.end()) or (
                    re.match(r"\s*the (?:\w+ )?commands? above", mark[command.end():]) and above)):
                problems.append(f"{where}: its record says no 'reproduce:' command (a code span, or 'the "
                                f"command above' with a command in a code block of the section before the table)")
    return problems


@pytest.mark.parametrize("page", RESULT_PAGES, ids=lambda p: p.name)
def test_every_result_table_names_its_record_or_is_historical(page):
    problems = result_table_problems(page.read_text(), page.parent)
    assert not problems, f"{page.relative_to(ROOT)}:\n" + "\n".join(problems)


def test_the_result_table_check_on_hand_cases(tmp_path):
    (tmp_path / "r.json").write_text("{}")
    table = "| method | P@1 |\n|---|---|\n| ict | 0.5 |\n"
    never = lambda commit: None  # noqa: E731 - no git history consulted
    check = lambda text: result_table_problems(text, tmp_path, commit_date=never)  # noqa: E731
    # a table with neither mark fails; so does a mark after the next heading or after the next table
    assert check(f"# A\n\n{table}\nText.\n") == ["the table at line 3 (| method | P@1 |...): no 'Record:' or "
                                               "'Historical:' paragraph after it"]
    assert len(check(f"# A\n\n{table}\n# B\n\nRecord: [r](r.json); reproduce: `python x.py`\n")) == 1
    assert len(check(f"# A\n\n{table}\n{table}\nRecord: [r](r.json); reproduce: `python x.py`\n")) == 1
    # a record: an existing file and a command
    assert check(f"# A\n\n{table}\nRecord: [r](r.json); reproduce: `python x.py --seed 0`.\n") == []
    assert check(f"# A\n\n```bash\nict-jax eval --n 4\n```\n\n{table}\nRecord: [r](r.json); reproduce: the command "
                 "above.\n") == []
    assert len(check(f"# A\n\n{table}\nRecord: [r](r.json); reproduce: the command above.\n")) == 1  # none above
    assert len(check(f"# A\n\n{table}\nRecord: [r](missing.json); reproduce: `python x.py`\n")) == 1
    assert len(check(f"# A\n\n{table}\nRecord: [r](r.json).\n")) == 1  # no command
    assert check(f"# A\n\n    python x.py\n\n{table}\nRecords: [r](r.json); reproduce the ict rows: the first command "
                 "above.\n") == []
    # historical: the commit, its date, no record, the command of that time
    good = "Historical: measured at commit abc1234 (2026-11-22), no record kept; the command of that time was `x`."
    assert check(f"# A\n\n{table}\n{good}\n") == []
    assert len(check(f"# A\n\n{table}\nHistorical: measured long ago.\n")) == 1
    assert check(f"# A\n\n{table}\n{good}\n".replace("no record kept", "gone")) != []
    dated = lambda commit: "2026-11-23"  # noqa: E731
    assert result_table_problems(f"# A\n\n{table}\n{good}\n", tmp_path, commit_date=dated) == [
        "the table at line 3 (| method | P@1 |...): commit abc1234 is dated 2026-11-23, not 2026-11-22"]
    also = "Record: [r](r.json), code of commit abc1234 (2026-11-22); reproduce: `python x.py`."
    assert len(result_table_problems(f"# A\n\n{table}\n{also}\n", tmp_path, commit_date=dated)) == 1
    # a table that documents a command's options needs no mark; a code block's pipes are no table
    assert check("# A\n\n| option | meaning |\n|---|---|\n| `--n` | samples |\n") == []
    assert check(f"# A\n\n```\n{table}```\n") == []


def test_the_result_table_check_fails_on_results_md_without_a_mark():
    """The real page with one mark taken out is caught: the check reads what the page holds."""
    text = RESULTS.read_text()
    marks = [m for m in re.finditer(r"^(Records?|Historical):", text, flags=re.M)]
    assert len(marks) >= 10
    m = marks[len(marks) // 2]
    broken = text[:m.start()] + "Notes:" + text[m.end():]
    problems = result_table_problems(broken, RESULTS.parent)
    assert len(problems) == 1 and "no 'Record:' or 'Historical:' paragraph" in problems[0], problems


# ------------------------------------------------------------------------------------------------
# An experiment's committed report is its record's: `ict-jax compare --plan P --report` changes nothing
# ------------------------------------------------------------------------------------------------
EXPERIMENTS = ROOT / "docs" / "experiments"


def test_every_committed_experiment_report_is_rebuilt_from_its_record_unchanged():
    """docs/experiments/<name>/report.md is what the report builder makes of experiment.json beside it, and
    the figures it names are there (a record committed with a report of older code fails here: rebuild it
    with `ict-jax compare --plan <plan> --report`)."""
    import json

    from ict_jax.experiments.report import FIGURES, format_report

    folders = sorted(p.parent for p in EXPERIMENTS.glob("*/experiment.json"))
    assert folders, f"no experiment records under {EXPERIMENTS}"
    for folder in folders:
        record = json.loads((folder / "experiment.json").read_text(encoding="utf-8"))
        assert (folder / "report.md").read_text(encoding="utf-8") == format_report(record), (
            f"{folder.relative_to(ROOT)}/report.md differs from its record's report")
        missing = [f for f in FIGURES if not (folder / f).is_file()]
        assert not missing, f"{folder.relative_to(ROOT)}: figures missing: {missing}"


# ------------------------------------------------------------------------------------------------
# User-facing text names topics, not the project's history: what changed when belongs in the git log
# ------------------------------------------------------------------------------------------------
#: where a reader meets the project's text; docs/experiments/ and configs/experiments/ hold experiments'
#: records and plans, written as they ran
HISTORY_FREE = ["README.md", "docs", "ict_jax", "tests", "benchmarks", "notebooks", "configs"]
HISTORY_EXEMPT = ["docs/experiments", "configs/experiments"]
HISTORY_SUFFIXES = {".md", ".py", ".yaml", ".yml", ".toml", ".txt", ".sh", ""}
#: a reference to a work item (the word issue and a number, singular or plural, any case) or a note of
#: which session of work did something (an ordinal or "this" before the word, and the like)
HISTORY = re.compile(r"\bissues? #?[0-9]+"
                     r"|\b(?:first|second|third|fourth|fifth|earlier|previous|this|that|next|last|later) session\b"
                     r"|\bin (?:this|that|any) session\b", re.IGNORECASE)


def history_notes(root: Path) -> list[str]:
    """``path:line: text`` of every history note in the user-facing files under ``root``."""
    found = []
    for name in HISTORY_FREE:
        base = root / name
        files = [base] if base.is_file() else sorted(f for f in base.rglob("*") if f.is_file()) if base.is_dir() else []
        for f in files:
            rel = f.relative_to(root).as_posix()
            if f.suffix not in HISTORY_SUFFIXES or any(rel.startswith(e + "/") for e in HISTORY_EXEMPT):
                continue
            if "__pycache__" in rel or "/." in "/" + rel:
                continue
            try:
                text = f.read_text()
            except (UnicodeDecodeError, OSError):
                continue
            for i, line in enumerate(text.splitlines(), 1):
                if HISTORY.search(line):
                    found.append(f"{rel}:{i}: {line.strip()[:100]}")
    return found


def test_user_facing_text_names_topics_not_the_projects_history():
    found = history_notes(ROOT)
    assert not found, ("name the topic, not the work item or session (the git log keeps the history):\n"
                       + "\n".join(found))


def test_the_history_scan_finds_a_note_added_back(tmp_path):
    word, session = "Issue", "session"  # spelled apart, so that this file itself passes the scan
    (tmp_path / "docs" / "experiments").mkdir(parents=True)
    (tmp_path / "tests").mkdir()
    (tmp_path / "README.md").write_text("# ict_jax\n\nThe trainer end to end.\n")
    (tmp_path / "docs" / "experiments" / "report.md").write_text(f"Run for {word.lower()} 33.\n")  # exempt
    (tmp_path / "tests" / "test_x.py").write_text('"""Scope="session" fixtures are no history."""\n')
    assert history_notes(tmp_path) == []
    (tmp_path / "tests" / "test_x.py").write_text(f'"""{word} 7: the trainer end to end."""\n')
    (tmp_path / "docs" / "a.md").write_text(f"Measured in the third {session} (no GPU in this {session}).\n"
                                           f"(see {word.lower()}s 5)\n")
    assert history_notes(tmp_path) == [
        f"docs/a.md:1: Measured in the third {session} (no GPU in this {session}).",
        f"docs/a.md:2: (see {word.lower()}s 5)",
        f"tests/test_x.py:1: \"\"\"{word} 7: the trainer end to end.\"\"\""]
