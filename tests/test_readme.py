"""The README is a newcomer's five minutes (issue 49): short, its links and cited docs exist, every `ott-gguf` and
llama.cpp command line in it parses with this build's options, its tiers table is docs/tiers-defaults.md's numbers, its
Python example runs, and its slot claim is what `ott-gguf serve` starts."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ott_gguf import _lib, cli
from ott_gguf.server import server_command

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# the pages that took the README's reference parts, results and history: their links are checked too
PAGES = [README, ROOT / "docs" / "usage.md", ROOT / "docs" / "results.md", ROOT / "docs" / "changelog.md"]
MAX_LINES = 220  # the issue asks for about 200: readable in five minutes

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def code_blocks(text: str, lang: str) -> list[str]:
    return [body for kind, body in FENCE.findall(text) if kind == lang]


def command_lines(text: str, program: str) -> list[list[str]]:
    """The command lines of `sh` blocks that run `program`, as argv without it (comments dropped)."""
    out = []
    for block in code_blocks(text, "sh"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words and words[0] == program:
                out.append(words[1:])
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", "")).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())  # a '#' line inside a code block is no heading
    return {slug(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short() -> None:
    n = len(README.read_text().splitlines())
    assert n <= MAX_LINES, f"README.md has {n} lines; a newcomer's page stays near 200 (details go to docs/)"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_exist(page: Path) -> None:
    assert page.is_file(), f"{page.relative_to(ROOT)} is missing"
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target} (no file {dest})")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target} (no heading with anchor #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_docs_the_readme_cites_exist() -> None:
    text = README.read_text()
    cited = set(re.findall(r"\bdocs/[\w./-]+\.(?:md|png|json)\b", text))
    assert cited, "the README cites no docs/ page: every number needs the page that regenerates it"
    missing = sorted(c for c in cited if not (ROOT / c).is_file())
    assert not missing, f"the README cites docs that do not exist: {missing}"


def cli_parser(monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """ott-gguf's real parser, as cli.main builds it (caught at its parse_args, so no command runs)."""

    class Built(Exception):
        pass

    def catch(self: argparse.ArgumentParser, *args: object, **kwargs: object) -> None:
        raise Built(self)

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", catch)
        with pytest.raises(Built) as built:
            cli.main(["models"])
    return built.value.args[0]


def test_every_ott_gguf_command_line_in_the_readme_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = cli_parser(monkeypatch)
    lines = command_lines(README.read_text(), "ott-gguf")
    assert len(lines) >= 8, f"the README's command-line block shows {len(lines)} ott-gguf commands"
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    documented = {argv[0] for argv in lines}
    assert documented >= {"generate", "chat", "serve", "info", "eval", "bench", "calibrate"}, documented
    usage = command_lines((ROOT / "docs" / "usage.md").read_text(), "ott-gguf")  # the reference page's too
    for argv in lines + usage:
        if argv[0] == "serve" and "--" in argv:
            argv = argv[: argv.index("--")]  # the rest goes to llama-server as it is (cli.main does the same)
        assert argv[0] in sub.choices, f"ott-gguf has no command {argv[0]!r}"
        # argparse exits (status 2, message on stderr) on an unknown option or a value its type refuses
        try:
            parser.parse_args(argv)
        except SystemExit as e:
            pytest.fail(
                f"`ott-gguf {shlex.join(argv)}` from the README or docs/usage.md does not parse (exit {e.code})"
            )


def test_llama_cpp_tool_options_in_the_readme_exist() -> None:
    text = README.read_text()
    tools = sorted({w for block in code_blocks(text, "sh") for w in re.findall(r"^(llama-[\w-]+)", block, re.M)})
    assert tools, "the README shows no llama.cpp tool command"
    for tool in tools:
        res = subprocess.run([str(_lib.bin_path(tool)), "-h"], capture_output=True, text=True, timeout=60)
        known = set(re.findall(r"(?<![\w-])(--?[A-Za-z][\w-]*)", res.stdout + res.stderr))
        for argv in command_lines(text, tool):
            unknown = [w for w in argv if w.startswith("-") and w not in known]
            assert not unknown, f"{tool} -h does not know {unknown} (README: {tool} {shlex.join(argv)})"


# the README's table: the current defaults, all rows of one run (docs/tiers.md: every variant, an earlier run)
TIERS_MD = ROOT / "docs" / "tiers-defaults.md"


def tiers_md_numbers() -> dict[str, dict[str, tuple[float, float, float]]]:
    """TIERS_MD's tables: model -> row label -> (mean KLD, top-1 %, bits/elem at 8k)."""
    out: dict[str, dict[str, tuple[float, float, float]]] = {}
    model = ""
    for line in TIERS_MD.read_text().splitlines():
        if line.startswith("### "):
            model = line[4:].strip()
        elif model and line.startswith("| ") and not line.startswith(("| K/V", "|---")):
            cells = [c.strip() for c in line.strip("|").split("|")]
            out.setdefault(model, {})[cells[0]] = (float(cells[1]), float(cells[4]), float(cells[7]))
    return out


# README row -> TIERS_MD row (the names study.tiers gives the same configuration)
TIER_ROWS = {
    "q8_0": "q8_0",
    "q4_0": "q4_0",
    "kivi2": "kivi2 +rotV",
    "ott2": "ott2 +rotV",
    "ott3/ott2": "ott3/ott2 +rotV",
    "quality tier": "ott3/ott2 +rotV +symV uniform 2-bit K R=64 --ott-layers",  # QUALITY_PARAMS: k_mix 1
    "ott3": "ott3 +rotV",
}


def test_the_readme_tiers_table_is_docs_tiers_md() -> None:
    tiers = tiers_md_numbers()
    smol, gemma = tiers["smollm2-135m"], tiers["gemma3-270m"]
    rows = [
        line for line in README.read_text().splitlines() if re.match(r"\| \*{0,2}(q8_0|q4_0|kivi2|ott|quality)", line)
    ]
    assert len(rows) == len(TIER_ROWS), rows
    for line in rows:
        cells = [c.replace("*", "").strip() for c in line.strip("|").split("|")]
        label = cells[0].split(" (")[0]
        assert label in TIER_ROWS, f"README tiers row {label!r} is not in {TIERS_MD.name}'s tables"
        want = TIER_ROWS[label]
        # README columns: label, then bits, KLD, vs q4_0, top-1 for SmolLM2 and the same four for Gemma 3
        for table, (bits, kld, top1) in (
            (smol, (cells[1], cells[2], cells[4])),
            (gemma, (cells[5], cells[6], cells[8])),
        ):
            key = next(k for k in table if k == want or (want.endswith("--ott-layers") and k.startswith(want)))
            m_kld, m_top1, m_bits = table[key]
            assert (float(bits), float(kld)) == (m_bits, m_kld), f"{label}: README {bits}/{kld}, tiers.md {table[key]}"
            assert float(top1.rstrip("%")) == pytest.approx(m_top1, abs=0.05), f"{label}: top-1 {top1} vs {m_top1}"


def test_the_readme_python_example_runs(smollm2: Path) -> None:
    """The first Python block, as a newcomer pastes it (1 thread; the model is already fetched)."""
    code = code_blocks(README.read_text(), "python")[0]
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    answer, size = res.stdout.strip().rsplit("\n", 1)
    assert answer.strip() and int(size) > 0, res.stdout


def test_the_readme_slot_claim_is_what_serve_starts(smollm2: Path) -> None:
    m = re.search(r"runs (\d+) slots \(`-np (\d+)`\)", README.read_text())
    assert m and m[1] == m[2], "the README says how many slots `ott-gguf serve` runs with an ott cache"
    cmd = server_command(smollm2, kv_type="ott2")
    assert cmd[cmd.index("-np") + 1] == m[1] and "--no-kv-unified" in cmd, cmd
