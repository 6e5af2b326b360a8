"""Which tensor of the graph first differs between the GPU and the CPU: the first ubatch of SmolLM2 with a cache type,
fully offloaded against -ngl 0, every named F32 tensor of the first layers compared as it is computed.

The per-position probe (logits_probe.py) found ott2's GPU logits apart from the CPU's from position 1 (KLD 0.034)
while the kernels pass their reference tests on the same GPU, so the difference enters between the graph and the
kernels. This probe reads the tensors themselves through llama.cpp's eval callback (cb_eval: the scheduler hands
over each node it was asked for once computed; ggml_backend_tensor_get copies it from the device): the layer's
inputs (Qcur, Kcur, Vcur), the ott ops' output (ott_attn), the attention block's output (kqv_out) and the layer's
(l_out), for layers 0..N-1, then the logits. Per tensor it prints the largest |GPU - CPU| relative to the tensor's
largest |CPU| value; the first row well above the matmul rounding (q8_0's rows, 1e-4..1e-3) names the op. The
callback makes the scheduler stop at each asked node (ggml-cuda's CUDA graphs and some fusions change), so the
probe also prints the logits' KLD under it: if that is small, the difference lives in what the callback turned off.

    python3 -m study.gpu_offline.tensor_probe [--kv ott2] [--layers 2] [--tokens 64]   # on a CUDA build
    python3 -m study.gpu_offline.tensor_probe --ngl 0 0 --kv2 f16   # anywhere: where ott2 and f16 part (kqv_out-0)
"""

from __future__ import annotations

import argparse
import ctypes
import re
import sys
from typing import Any

import llama_cpp
import llama_cpp.llama_cpp as lc
import numpy as np

from ott_gguf import Llama, _lib, models
from ott_gguf.corpus import docs_text

from .logits_probe import kld_rows

GGML_TYPE_F32 = 0
NAME = re.compile(r"^(Qcur|Kcur|Vcur|ott_attn|kqv_out|attn_out|ffn_out|l_out)-(\d+)$")


def ggml() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(_lib.lib_path("ggml-base")))
    for name, res, args in (
        ("ggml_get_name", ctypes.c_char_p, [ctypes.c_void_p]),
        ("ggml_nelements", ctypes.c_int64, [ctypes.c_void_p]),
        ("ggml_nbytes", ctypes.c_size_t, [ctypes.c_void_p]),
        ("ggml_is_contiguous", ctypes.c_bool, [ctypes.c_void_p]),
        ("ggml_backend_tensor_get", None, [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]),
    ):
        f = getattr(lib, name)
        f.restype, f.argtypes = res, args
    return lib


def capture(
    model: str, kv: str, tokens: list[int], ngl: int, layers: int
) -> tuple[dict[str, list[np.ndarray]], np.ndarray]:
    """The named F32 tensors of layers < `layers` in the order computed (a name can repeat: rope's input and output
    are both Qcur-0), and the logits of every token, for one ubatch of `tokens`."""
    g = ggml()
    seen: dict[str, list[np.ndarray]] = {}

    def wanted(t: int) -> str | None:
        name = (g.ggml_get_name(t) or b"").decode(errors="replace")
        m = NAME.match(name)
        if not m or int(m.group(2)) >= layers:
            return None
        # the tensor's type is the first field of struct ggml_tensor
        if ctypes.c_int32.from_address(t).value != GGML_TYPE_F32 or not g.ggml_is_contiguous(t):
            return None
        return name

    @lc.ggml_backend_sched_eval_callback
    def cb(t: int, ask: bool, _ud: Any) -> bool:
        name = wanted(t)
        if name is None:
            return False if ask else True
        if ask:
            return True
        buf = np.empty(g.ggml_nelements(t), np.float32)
        g.ggml_backend_tensor_get(t, buf.ctypes.data, 0, g.ggml_nbytes(t))
        seen.setdefault(name, []).append(buf)
        return True

    default = lc.llama_context_default_params

    def with_cb() -> Any:  # the stock Llama builds its context from these
        p = default()
        p.cb_eval = cb
        return p

    lc.llama_context_default_params = with_cb
    try:
        llm = Llama(model, kv_type=kv, n_ctx=512, n_batch=512, n_ubatch=512, n_gpu_layers=ngl, logits_all=True,
                    verbose=False)  # fmt: skip
    finally:
        lc.llama_context_default_params = default
    try:
        llm.eval(tokens)
        logits = np.array(llm.scores[: len(tokens)], np.float32)
    finally:
        llm.close()
    return seen, logits


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default="ott2")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--ngl", nargs=2, type=int, default=[0, 99], help="the two runs' offloaded layers (0 99)")
    ap.add_argument("--kv2", default=None, help="the second run's cache type (default: --kv; a check of the probe)")
    args = ap.parse_args(argv)
    model = str(models.fetch("smollm2-135m", quiet=True))
    vocab = Llama(model, vocab_only=True, verbose=False)
    tokens = vocab.tokenize(docs_text(40_000).encode())[: args.tokens]
    vocab.close()
    a, la = capture(model, args.kv, tokens, args.ngl[0], args.layers)
    kv2 = args.kv2 or args.kv
    b, lb = capture(model, kv2, tokens, args.ngl[1], args.layers)
    print(f"{args.kv} -ngl {args.ngl[0]} against {kv2} -ngl {args.ngl[1]}, {len(tokens)} tokens, llama-cpp-python "
          f"{llama_cpp.__version__}: max |b - a| / max |a| per tensor, in the order computed")  # fmt: skip
    for name in a:  # the order of the first run's graph
        for i, x in enumerate(a[name]):
            if name not in b or i >= len(b[name]) or b[name][i].shape != x.shape:
                print(f"  {name}#{i}: no counterpart in the second run")
                continue
            y = b[name][i]
            scale = float(np.abs(x).max()) or 1.0
            d = np.abs(y - x)
            rel, mean = float(d.max()) / scale, float(d.mean()) / scale
            print(f"  {name}#{i:<2d} n {x.size:>7d}  rel {rel:.2e}  mean {mean:.2e}  argmax {int(d.argmax())}")
    k = kld_rows(la, lb)
    print(f"logits under the callback: KLD mean {k.mean():.5f}, positions 0-7 {np.round(k[:8], 4).tolist()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
