"""The prepared GPU pass (study/gpu_offline, docs/gpu-offline.md) runs only when a GPU is lent, for minutes: what it
names must exist before then. Without a GPU: its scripts parse, every pytest selection it runs selects tests, every
study module it runs accepts the options it passes, and the texts it reads are in the pinned llama.cpp tree. A test
renamed without the pass would otherwise cost a lease's minutes ("no tests ran")."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from helpers import ROOT

PASS = ROOT / "study" / "gpu_offline"
PIPELINE = (PASS / "pipeline.sh").read_text()


@pytest.mark.parametrize("script", sorted(p.name for p in PASS.glob("*.sh")))
def test_the_pass_scripts_parse(script: str) -> None:
    res = subprocess.run(["bash", "-n", str(PASS / script)], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr


def selections(text: str) -> list[tuple[str, str]]:
    """(test file, -k expression) of every `$PT FILE -k EXPR` in the pipeline (EXPR quoted or one word); a `$kv` in
    EXPR takes each value of the `for kv in ...` loop around it, an expression made at run time (`$crashed`) is left
    out."""
    out = []
    for m in re.finditer(r"\$PT (\S+\.py) -k (?:\"([^\"]+)\"|([^\s\"]+))", text):
        file, expr = m.group(1), m.group(2) or m.group(3)
        if "$crashed" in expr:
            continue
        if "$kv" in expr:
            loops = re.findall(r"for kv in ([\w ]+);", text[: m.start()])
            assert loops, f"no `for kv in` loop before {m.group(0)}"
            out += [(file, expr.replace("$kv", kv)) for kv in loops[-1].split()]
        else:
            out.append((file, expr))
    return out


def test_every_pytest_selection_of_the_pass_selects_tests() -> None:
    """Collected here (the GPU tests are skipped without a GPU, but collected), matched as pytest's -k matches: an
    expression over substrings of the test's names (its file, its function with its parameters)."""
    sel = selections(PIPELINE)
    files = sorted({f for f, _ in sel})
    # the selections the pass depends on: the kernels against the reference, ott2's GPU logits, batch invariance
    assert {"test_cuda_emu.py", "test_gpu.py", "test_same_answer.py", "test_build.py"} <= set(files), files
    res = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files],
                         cwd=ROOT / "tests", capture_output=True, text=True, timeout=300)  # fmt: skip
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    ids = [line for line in res.stdout.splitlines() if "::" in line]
    for file, expr in sel:
        names = [[p.lower() for p in i.split("/")[-1].split("::")] for i in ids if i.split("::")[0].endswith(file)]
        k = Expression.compile(expr)
        hits = [n for n in names if k.evaluate(lambda s, n=n, **_: any(s.lower() in x for x in n))]
        assert hits, f'pipeline.sh runs `{file} -k "{expr}"`, which selects none of its {len(names)} tests'


def test_every_study_module_of_the_pass_takes_its_options() -> None:
    runs = re.findall(r"python3 -m (study\.[\w.]+)((?: --[\w-]+(?: [\w-]+)?)*)", PIPELINE)
    modules = {m for m, _ in runs}
    assert {"study.random_gguf", "study.gpu_offline.logits_probe", "study.gpu_offline.tensor_probe"} <= modules
    helps = {}
    for module in sorted(modules):
        res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)  # fmt: skip
        assert res.returncode == 0, (module, res.stderr[-2000:])
        helps[module] = res.stdout
        for opts in (o for m, o in runs if m == module):
            for opt in re.findall(r"--[\w-]+", opts):
                assert re.search(rf"{opt}\b", res.stdout), f"pipeline.sh passes {opt} to {module}, which has no {opt}"
    assert "llama3-8b" in helps["study.random_gguf"]  # the 8B shape it writes, by name


def test_the_texts_and_shapes_the_pass_reads_exist() -> None:
    """The KL divergence step reads three of the pinned llama.cpp's docs; the harness is asked for its shapes."""
    from ott_gguf import build_info

    docs = Path(str(build_info()["llama_src"])) / "docs"
    m = re.search(r"cat ((?:\$D/[\w-]+\.md ?)+)>", PIPELINE)
    assert m, "the KL divergence step's text"
    for name in re.findall(r"\$D/([\w-]+\.md)", m.group(1)):
        assert (docs / name).is_file(), f"pipeline.sh reads {name}, which the pinned llama.cpp's docs lack"
    bench = (ROOT / "native" / "tests" / "ott-bench.cu").read_text()
    for shape in {"smol", "llama8b"} | set(re.findall(r"for shape in ([\w ]+);", PIPELINE)[0].split()):
        assert f'{{ "{shape}",' in bench, f"ott-bench has no shape {shape}"
    # the options it passes the harness are in the harness's usage (its parser refuses others)
    usage = re.search(r'usage =\n((?:\s+".*"\n)+)', bench)
    assert usage, "ott-bench's usage"
    for opt in set(re.findall(r"ott-bench (--[\w-]+)", PIPELINE)):
        assert f"[{opt}]" in usage.group(1) or f"{opt}|" in usage.group(1) or f"|{opt}" in usage.group(1), opt


def test_decode_kernels_sums_the_decode_phase_of_an_nsys_trace(tmp_path: Path) -> None:
    """study/gpu_offline/decode_kernels.py on a trace laid out as `nsys stats -r cuda_gpu_trace -f csv` writes it: a
    warmup token (matrix-vector kernels), the depth fill (batched matmuls: mul_mat_q), two decoded tokens; the copies
    and everything up to the fill's last batched matmul are left out, each kernel summed by name per token."""
    sys.path.insert(0, str(ROOT))
    from study.gpu_offline.decode_kernels import decode_phase, main, read_trace, short_name

    head = "Start (ns),Duration (ns),CorrId,GrdX,GrdY,GrdZ,BlkX,BlkY,BlkZ,Reg/Trd,Strm,Name"
    mmvq = "void mul_mat_vec_q<(ggml_type)3, 1>(const void *, const void *, float *, int, int)"
    mmq = "void mul_mat_q<(ggml_type)3, 128, false>(const char *, const int *, float *, int, int)"
    part = "void ott2_cuda_k2mv2g128x64_attn_part_vec<2, 4, 16>(ott_cu_args)"
    rows = [(0, 900, mmvq), (1000, 50_000, mmq), (60_000, 7_000, part), (70_000, 40_000, mmq)]  # warmup, fill
    t = 200_000
    for _ in range(2):  # two decoded tokens: 3 matrix-vector kernels, the partials, a copy
        for name, dur in (
            (mmvq, 1_000),
            (mmvq, 2_000),
            (part, 4_000),
            ("[CUDA memcpy Device-to-Host]", 500),
            (mmvq, 3_000),
        ):
            rows.append((t, dur, name))
            t += dur + 100
    csv_path = tmp_path / "ott2_cuda_gpu_trace.csv"
    lines = ["", "Processing [ott2.sqlite] with [cuda_gpu_trace.py]... ", "", head]
    lines += [f'{s},{d},1,1,1,1,128,1,1,32,7,"{n}"' for s, d, n in rows]
    csv_path.write_text("\n".join(lines) + "\n")

    assert short_name(mmvq) == "mul_mat_vec_q<(ggml_type)3, 1>" and short_name(part).endswith("<2, 4, 16>")
    trace = read_trace(csv_path)
    assert len(trace) == 4 + 2 * 4  # the copies left out
    ph = decode_phase(trace)
    assert ph.kernels == {"mul_mat_vec_q<(ggml_type)3, 1>": [12_000, 6], short_name(part): [8_000, 2]}
    assert ph.busy_ns == 20_000 and ph.launches == 8
    assert ph.span_ns == t - 100 - 200_000  # the first decoded kernel's start to the last one's end
    out = subprocess.run(
        [sys.executable, "-m", "study.gpu_offline.decode_kernels", "--tokens", "2", f"a={csv_path}", f"b={csv_path}"],
        cwd=ROOT, capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    # us per token: 12 us / 2 of matrix-vector kernels (3 launches a token), 4 of the partials, 10 in all
    assert re.search(r"^mul_mat_vec_q<\(ggml_type\)3, 1> +6\.00 \( 3\.0\) +6\.00 \( 3\.0\)$", out, re.M), out
    assert re.search(r"^ott2_cuda_k2mv2g128x64_attn_part_vec<2, 4, 16> +4\.00 \( 1\.0\)", out, re.M), out
    assert re.search(r"^all kernels: device time +10\.00", out, re.M), out
    # a trace without the depth fill is refused, with the reason
    fill_less = tmp_path / "no_fill.csv"
    fill_less.write_text("\n".join([head, f'0,900,1,1,1,1,1,1,1,1,1,"{mmvq}"']) + "\n")
    with pytest.raises(SystemExit, match="no batched matmul"):
        main(["--tokens", "1", f"x={fill_less}"])


SWEEP_LOG = """\
# ott2 smol depth 4096: n_ctx 4352, NG 33, NS 9 (SG 4), sealed 31 groups, ring 128 tokens; sealing event at n_pos 4127
sweep smol       4096     1    9 <2,4,16>*         36      20.0      19.0  0.00e+00
sweep smol       4096     1    9 <2,4,8>           36      15.0      14.0  2.00e-07
sweep smol       4096     1   18 <2,4,8>           63      10.0       9.0  2.00e-07
sweep smol       4096     1    4 <2,4,16>          21      30.0      29.0  2.00e-07
# ott2 smol depth 4000, a ubatch of 128 tokens: n_ctx 4352, NG 33, NS 9 (SG 4), sealed 31 groups (32 after), ring 32
sweep smol       4096   128    9 <2,4,16>*        576     500.0     490.0  0.00e+00
sweep smol       4096   128    9 <2,2,16>         576       1.0       0.9  0.00e+00
# ott2 llama8b depth 4096: n_ctx 4352, NG 33, NS 9 (SG 4), sealed 31 groups, ring 128 tokens; sealing event at n_pos
sweep llama8b    4096     1    9 <4,4,8>*          96      20.0      19.0  0.00e+00
sweep llama8b    4096     1    4 <4,4,8>           64      19.5      19.0  1.00e-07
sweep llama8b    4096     1   18 <4,4,8>          176      15.0      14.0  1.00e-07
"""


def test_sweep_pick_names_the_knobs_of_the_fastest_decode_partials(tmp_path: Path) -> None:
    """study/gpu_offline/sweep_pick.py on the sweep's output: the fastest decoded token's row (prefill rows left out),
    as the tuning knobs that give it to the model, the slice count as groups per slice; nothing where the
    launcher's is within the margin; a shape the sweep did not reach refused."""
    from study.gpu_offline.sweep_pick import pick

    # 10 us at NS 18 with 8 warps: another instance and 2 groups per slice (NS = ceil(33/2) = 17: SG 2 as at 18)
    assert pick(SWEEP_LOG, "smol", 4096, 0.05) == "OTT_CUDA_PART=2,4,8 OTT_SLICE_GROUPS=2"
    assert pick(SWEEP_LOG, "smol", 4096, 0.6) == ""  # 10 us is not 60% faster than 20
    assert pick(SWEEP_LOG, "llama8b", 4096, 0.05) == "OTT_SLICE_GROUPS=2"  # the launcher's instance, more slices
    assert pick(SWEEP_LOG.replace("15.0      14.0  1.00e-07", "19.5      19.0  1.00e-07"), "llama8b", 4096, 0.05) == ""
    with pytest.raises(ValueError, match="no decode case for llama8b at depth 32768"):
        pick(SWEEP_LOG, "llama8b", 32768, 0.05)
    log = tmp_path / "sweep.log"
    log.write_text(SWEEP_LOG)
    res = subprocess.run([sys.executable, "-m", "study.gpu_offline.sweep_pick", "--shape", "smol", "--depth", "4096",
                          str(log)], cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert res.returncode == 0 and res.stdout.strip() == "OTT_CUDA_PART=2,4,8 OTT_SLICE_GROUPS=2", res
