"""Where the GPU's ott2 logits leave the CPU's: KL divergence (CPU || GPU) per position, for the cache types and
variants below, on the first 300 tokens of the docs text (SmolLM2, fully offloaded against -ngl 0).

On the H200 (2026-11-30) ott2 differed from position 1 on (KLD 0.034 there) while q8_0 was equal to 4 decimals at
positions 1-5 and the kernels' CPU emulation equalled the CPU path at positions 1-2: a difference on the GPU only,
neither in the kernels' logic nor in the rest of the model. The variants split the cache's paths: 4-bit codes on
one side or both (the ott caches hold both sides: f16 on one is refused), no outlier pools (kivi2), values not
rotated, uniform key widths, token by token (the decode kernels and the fused merge with the seal) instead of one
ubatch (the prefill rows). ggml-cuda's switches are read once per process, so the pass runs the probe again with
one of them set and --only ott2: GGML_CUDA_DISABLE_FUSION=1 (its fused rope/set_rows and norm paths),
GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32, GGML_CUDA_DISABLE_GRAPHS=1.

    python3 -m study.gpu_offline.logits_probe [--tokens N] [--only LABEL ...]   # on a CUDA build
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import numpy as np

from ott_gguf import Llama, models
from ott_gguf.corpus import docs_text
from ott_gguf.evaluate import eval_logits

# (label, cache type, ubatch, ott_config)
VARIANTS: list[tuple[str, str, int, dict[str, Any] | None]] = [
    ("q8_0 (control)", "q8_0", 512, None),
    ("ott2", "ott2", 512, None),
    ("ott4", "ott4", 512, None),
    ("ott4 K, ott2 V", "ott4/ott2", 512, None),
    ("ott2 K, ott4 V", "ott2/ott4", 512, None),
    ("kivi2 (no pools)", "kivi2", 512, None),
    ("ott2 v_rotate 0", "ott2", 512, {"v_rotate": False}),
    ("ott2 k_mix 1", "ott2", 512, {"k_mix": 1}),
    ("ott2 token by token", "ott2", 1, None),
    ("q8_0 token by token", "q8_0", 1, None),
]


def kld_rows(p: np.ndarray, q: np.ndarray) -> np.ndarray:
    """KL(softmax(p) || softmax(q)) per row, in float64."""
    p = p.astype(np.float64) - p.max(1, keepdims=True)
    q = q.astype(np.float64) - q.max(1, keepdims=True)
    lp = p - np.log(np.exp(p).sum(1, keepdims=True))
    lq = q - np.log(np.exp(q).sum(1, keepdims=True))
    return (np.exp(lp) * (lp - lq)).sum(1)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=300)
    ap.add_argument("--only", nargs="*", default=None, help="labels of VARIANTS to run (default: all)")
    args = ap.parse_args(argv)
    switches = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("GGML_CUDA_"))
    model = str(models.fetch("smollm2-135m", quiet=True))
    llm = Llama(model, vocab_only=True, verbose=False)
    tokens = llm.tokenize(docs_text(40_000).encode())[: args.tokens]
    llm.close()
    for label, kv, ub, cfg in VARIANTS:
        if args.only is not None and label not in args.only:
            continue
        if switches:
            label = f"{label} [{switches}]"
        kw: dict[str, Any] = {} if cfg is None else {"ott_config": cfg}
        try:
            cpu = eval_logits(model, kv, tokens, n_ctx=512, ubatch=ub, n_gpu_layers=0, **kw)
            gpu = eval_logits(model, kv, tokens, n_ctx=512, ubatch=ub, n_gpu_layers=99, **kw)
        except Exception as exc:  # noqa: BLE001 - a probe: one failing variant must not hide the others
            print(f"{label:22s} failed: {exc}", flush=True)
            continue
        k = kld_rows(cpu, gpu)
        top1 = float(np.mean(cpu.argmax(1) == gpu.argmax(1)))
        print(f"{label:22s} mean {k.mean():.5f} top-1 {top1:.3f} positions 0-7 {np.round(k[:8], 4).tolist()} "
              f"max {k.max():.4f} at {int(k.argmax())}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
