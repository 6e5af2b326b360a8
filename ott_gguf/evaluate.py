"""Quality of K/V cache types against the f16 cache on real text: KL divergence, perplexity ratio, top-1 agreement.

`ott-gguf eval MODEL` evaluates the same token chunks with every requested cache type and compares each type's
logits with those of the f16 cache, position by position. Each chunk starts from an empty cache (as
llama-perplexity does) and is fed in ubatches of `ubatch` tokens: a token sees the cache as it was stored before
its ubatch plus its own ubatch. The stock quantized types quantize a ubatch before attending to it, whereas
ott2/kivi2 keep their recent tokens in fp16 and seal (quantize) a group only once R newer tokens follow it, so
ubatches as long as the chunk would never let ott2 attend to a sealed group; small ubatches are close to
generation, where tokens come one at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .kv_types import OttConfig, kv_pair_name, resolve_kv_types

__all__ = ["EvalRow", "evaluate", "eval_logits", "kl_divergence", "log_softmax", "plot_eval", "text_chunks"]

REFERENCE = "f16"
DEFAULT_KV_TYPES: tuple[str, ...] = ("f16", "q8_0", "q4_0", "kivi2", "ott2")


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax of (n_tokens, n_vocab) logits, in float64."""
    a = np.asarray(logits, np.float64)
    la = a - a.max(axis=1, keepdims=True)
    la -= np.log(np.exp(la).sum(axis=1, keepdims=True))
    return la


KLD_ROWS = 16  # rows per block of kl_divergence (a block's float32 temporaries stay in the caches)


def kl_divergence(ref_logits: np.ndarray, logits: np.ndarray) -> np.ndarray:
    """Per-token KL(p_ref || p) of two logit matrices (n_tokens, n_vocab), in blocks of rows.

    KL = sum_i p_i (a_i - b_i) - lse(a) + lse(b) for logits a (ref) and b, since sum_i p_i = 1: two exponentials per
    element, in float32, and the sums in float64 (a 262k-token vocabulary: 4x faster than three log-softmaxes in
    float64; the test against the float64 definition is in tests/test_cli_tools.py)."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"logit shapes differ: {ref_logits.shape} and {logits.shape}")
    out = np.empty(ref_logits.shape[0], np.float64)
    for i in range(0, ref_logits.shape[0], KLD_ROWS):
        a = np.asarray(ref_logits[i : i + KLD_ROWS], np.float32)
        b = np.asarray(logits[i : i + KLD_ROWS], np.float32)
        ma, mb = a.max(axis=1, keepdims=True), b.max(axis=1, keepdims=True)
        ea = np.exp(a - ma)
        sa = ea.sum(axis=1, dtype=np.float64)
        sb = np.exp(b - mb).sum(axis=1, dtype=np.float64)
        pd = np.einsum("ij,ij->i", ea, a - b, dtype=np.float64) / sa
        out[i : i + KLD_ROWS] = pd - (ma[:, 0] + np.log(sa)) + (mb[:, 0] + np.log(sb))
    return out


def eval_logits(model: Path | str, kv_type: str, tokens: list[int], n_ctx: int = 2048, ubatch: int = 512,
                first: int = 0, kv_bytes: list[int] | None = None, **kw: object) -> np.ndarray:  # fmt: skip
    """Logits of positions first..len(tokens)-1 of `tokens`, evaluated from an empty cache of the given type (or
    "K/V" pair of types) in ubatches; shape (len(tokens) - first, n_vocab).

    Only the positions asked for get logits (llama.cpp computes the output layer for the flagged tokens only, as
    llama-perplexity's KL divergence scores only the second half of each chunk): with a 262k-token vocabulary the
    output layer costs more than the rest of a small model. kv_bytes: a list that gets the bytes the context's K/V
    cache allocated."""
    from .llama import Llama

    if not 0 <= first < len(tokens):
        raise ValueError(f"need 0 <= first < {len(tokens)} tokens, got first={first}")
    llm = Llama(str(model), kv_type=kv_type, n_ctx=n_ctx, n_batch=ubatch, n_ubatch=ubatch, verbose=False, **kw)
    try:
        if kv_bytes is not None:
            from . import _lib

            kv_bytes.append(_lib.kv_cache_bytes(llm._ctx.ctx))
        n_vocab = llm.n_vocab()
        out = np.empty((len(tokens) - first, n_vocab), np.float32)
        b = llm._batch.batch
        for i in range(0, len(tokens), ubatch):
            chunk = tokens[i : i + ubatch]
            b.n_tokens = len(chunk)
            for j, t in enumerate(chunk):
                b.token[j], b.pos[j], b.seq_id[j][0], b.n_seq_id[j] = t, i + j, 0, 1
                b.logits[j] = i + j >= first
            llm._ctx.decode(llm._batch)  # raises on failure
            n_out = max(0, i + len(chunk) - max(i, first))
            if n_out:
                # llama.cpp keeps the flagged tokens' logits in batch order
                rows = np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_out, n_vocab))
                out[max(i, first) - first : i + len(chunk) - first] = rows
        return out
    finally:
        llm.close()


def text_chunks(model: Path | str, text: str, n_ctx: int, chunks: int) -> list[list[int]]:
    """Up to `chunks` consecutive slices of n_ctx tokens of `text`, each led by BOS when the model adds one.

    Only whole slices are used, except that a text shorter than one slice gives that one shorter slice."""
    from .info import captured_log
    from .llama import Llama

    if n_ctx < 2 or chunks < 1:
        raise ValueError(f"need n_ctx >= 2 and chunks >= 1, got n_ctx={n_ctx}, chunks={chunks}")
    with captured_log():  # a vocab-only context warns that it has no training context; nothing to report
        vocab = Llama(str(model), vocab_only=True, verbose=False)
    try:
        bos = vocab.tokenize(b"", add_bos=True)  # [] for models that add no BOS (SmolLM2)
        toks = vocab.tokenize(text.encode(), add_bos=False)
    finally:
        vocab.close()
    body = n_ctx - len(bos)
    out = [bos + toks[i : i + body] for i in range(0, len(toks) - body + 1, body)][:chunks]
    if not out and len(bos) + len(toks) >= 2:
        out = [bos + toks]
    if not out:
        raise ValueError("the text has fewer than 2 tokens")
    return out


@dataclass(frozen=True)
class EvalRow:
    """One cache type against the f16 cache over all evaluated positions."""

    kv_type: str  # "ott2", or "ott3/ott2" for K/V types that differ
    chunks: int
    n_tokens: int  # positions compared (KLD, top-1); perplexity scores the n_tokens - chunks next tokens
    mean_kld: float  # mean KL(p_f16 || p_type) per position, nats
    max_kld: float
    ppl: float  # perplexity of the text under this type's logits
    ppl_ratio: float  # ppl / ppl of f16
    top1: float  # fraction of positions whose argmax equals f16's
    bits_per_element: float | None = None  # the cache's bytes at n_ctx over the K and V elements of n_ctx tokens


@dataclass
class _Acc:
    kld: list[np.ndarray]
    nll: list[np.ndarray]
    same: int = 0
    n: int = 0


def _nll(logits: np.ndarray, tokens: list[int]) -> np.ndarray:
    """Negative log-likelihood of each next token (position i predicts token i + 1)."""
    lp = log_softmax(logits[:-1])
    return -lp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]


def evaluate(
    model: Path | str,
    kv_types: Sequence[str] = DEFAULT_KV_TYPES,
    *,
    text: str | None = None,
    n_ctx: int = 2048,
    chunks: int = 4,
    ubatch: int = 16,
    n_threads: int | None = None,
    progress: Callable[[str], None] | None = None,
    tiers: dict[str, tuple[str, OttConfig | None]] | None = None,
) -> list[EvalRow]:
    """Compare each cache type's logits with the f16 cache's on the same chunks of `text`.

    kv_types: names, or "K/V" pairs such as "ott3/ott2" (rows are named like that, or by the one type of a pair
    that agrees), or labels that `tiers` maps to a pair and its configuration (a --kv-tier). text defaults to the
    pinned llama.cpp docs (ott_gguf.corpus). f16 is evaluated once as the
    reference; an f16 row, when asked for, is a second, independent f16 run (so its zero KLD shows the evaluation
    is deterministic). One context at a time is alive, with one chunk's reference logits: memory stays at one
    chunk's worth.
    """
    from .info import require_ott_support

    tiers = tiers or {}
    types = [t if t in tiers else kv_pair_name(*resolve_kv_types(t)) for t in kv_types]
    if not types:
        raise ValueError("no K/V cache types to evaluate")
    if ubatch < 1:
        raise ValueError(f"ubatch must be >= 1, got {ubatch}")
    if not Path(model).is_file():
        raise FileNotFoundError(f"model file not found: {model}")
    require_ott_support(model, [tiers[t][0] if t in tiers else t for t in types])  # before the reference run
    if text is None:
        from .corpus import docs_text

        # ~4 bytes per token in English/Markdown: twice that leaves room; the cut is at a character boundary
        text = docs_text(max(8 * n_ctx * chunks, 4096))
    token_chunks = text_chunks(model, text, n_ctx, chunks)
    kw: dict[str, object] = {} if n_threads is None else {"n_threads": n_threads, "n_threads_batch": n_threads}
    acc = {t: _Acc([], []) for t in types}
    allocated: dict[str, list[int]] = {t: [] for t in types}
    ref_nll: list[np.ndarray] = []
    for ci, toks in enumerate(token_chunks):
        if progress:
            progress(f"chunk {ci + 1}/{len(token_chunks)} ({len(toks)} tokens): {REFERENCE} reference")
        ref = eval_logits(model, REFERENCE, toks, n_ctx=n_ctx, ubatch=ubatch, **kw)
        ref_top = ref.argmax(axis=1)
        ref_nll.append(_nll(ref, toks))
        for t in types:
            if progress:
                progress(f"chunk {ci + 1}/{len(token_chunks)}: {t}")
            pair, cfg = tiers.get(t, (t, None))
            got = eval_logits(model, pair, toks, n_ctx=n_ctx, ubatch=ubatch, kv_bytes=allocated[t],
                              **({**kw, "ott_config": cfg} if cfg is not None else kw))  # fmt: skip
            a = acc[t]
            a.kld.append(kl_divergence(ref, got))
            a.nll.append(_nll(got, toks))
            a.same += int((got.argmax(axis=1) == ref_top).sum())
            a.n += len(toks)
    ref_ppl = float(np.exp(np.concatenate(ref_nll).mean()))
    elements = _kv_elements(model, n_ctx)
    rows = []
    for t in types:
        a = acc[t]
        kld = np.concatenate(a.kld)
        ppl = float(np.exp(np.concatenate(a.nll).mean()))
        bits = 8.0 * allocated[t][0] / elements if elements else None
        rows.append(EvalRow(t, len(token_chunks), a.n, float(kld.mean()), float(kld.max()), ppl, ppl / ref_ppl,
                            a.same / a.n, bits))  # fmt: skip
    return rows


def _kv_elements(model: Path | str, n_ctx: int) -> int:
    """K and V elements of n_ctx tokens in every layer (0 when the GGUF gives per-layer KV head counts)."""
    from .info import model_info

    mi = model_info(model)
    if mi.n_head_kv is None:
        return 0
    return n_ctx * mi.n_layer * mi.n_head_kv * (mi.head_dim_k + mi.head_dim_v)


def plot_eval(rows: Sequence[EvalRow], path: Path | str, title: str = "") -> None:
    """A bar chart per measure (mean KLD, perplexity ratio, top-1 agreement), one bar per cache type."""
    plt = import_pyplot()
    names = [r.kv_type + ("" if r.bits_per_element is None else f"\n{r.bits_per_element:.2f} bits") for r in rows]
    panels = [
        ("mean KLD vs f16 (nats)", [r.mean_kld for r in rows]),
        ("perplexity / f16's", [r.ppl_ratio for r in rows]),
        ("top-1 same as f16 (%)", [100 * r.top1 for r in rows]),
    ]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (label, values) in zip(axes, panels, strict=True):
        bars = ax.bar(names, values, color="tab:blue")
        ax.bar_label(bars, fmt="%.3g", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.tick_params(axis="x", labelrotation=30)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def import_pyplot():  # -> module
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("--plot needs matplotlib: pip install 'ott-gguf[report]'") from e
    return plt
