"""`ott-gguf` command line: chat, generate, serve, info, eval, bench, models, build-info."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from . import models

if TYPE_CHECKING:
    from .kv_types import OttConfig


def _model_path(arg: str | None) -> Path:
    """A GGUF path, or the name of a registry model (fetched on first use)."""
    if arg is None:
        return models.fetch(models.DEFAULT_MODEL)
    if arg in models.MODELS:
        return models.fetch(arg)
    p = Path(arg)
    if not p.exists():
        raise SystemExit(f"ott-gguf: no such model file or known model name: {arg} (known: {', '.join(models.MODELS)})")
    return p


def _kv_types(args: argparse.Namespace) -> str:
    """--kv-type with --type-k/--type-v over one side each, validated: "ott2", or "ott3/ott2" (K/V); with --kv-tier,
    checked that none of the explicit options is given too (the tier's pair is resolved with the model, _cache)."""
    from .kv_types import kv_pair_name, resolve_kv_types

    tier = getattr(args, "kv_tier", None)
    if tier is not None:
        options = (("--kv-type", args.kv_type), ("-ctk", args.type_k), ("-ctv", args.type_v),
                   ("--ott-params", getattr(args, "ott_params", "")), ("--ott-layers", args.ott_layers))  # fmt: skip
        given = [flag for flag, value in options if value]
        if given:
            raise ValueError(f"--kv-tier {tier} chooses the K/V types and their parameters; {', '.join(given)} would "
                             "override it: give --kv-tier alone, or the explicit options alone")  # fmt: skip
        return tier
    return kv_pair_name(*resolve_kv_types(args.kv_type or args.kv_type_default, args.type_k, args.type_v))


def _cache(args: argparse.Namespace, path: Path) -> tuple[str, OttConfig | None]:
    """The K/V pair and configuration the options ask for: --kv-tier's for this model (said in one line on
    stderr), else --kv-type/-ctk/-ctv with --ott-params/--ott-layers."""
    kv_type = _kv_types(args)
    if getattr(args, "kv_tier", None) is None:
        return kv_type, _ott_config(args, kv_type)
    from .tiers import resolve_tier

    tier = resolve_tier(args.kv_tier, path)
    print(tier.line, file=sys.stderr, flush=True)
    return tier.kv_type, tier.ott_config


def _add_kv_type_args(p: argparse.ArgumentParser, default: str, tier: bool = True) -> None:
    from .kv_types import KV_TYPES
    from .tiers import KV_TIERS

    p.set_defaults(kv_type_default=default, kv_tier=None)
    if tier:
        p.add_argument("--kv-tier", choices=KV_TIERS,
                       help="a named K/V cache tier instead of the options below (docs/kv-tiers.md): compact = ott2 "
                       "with symmetric value blocks (~2.6 bits per element) and the model's calibrated 3-bit key "
                       "layers when an ott2 calibration is found (<= 2.8 bits), quality = ott3/ott2 with "
                       "--ott-params 128,64,3,32,2,1,1,1 and the model's calibrated --ott-layers when a calibration "
                       "is found (~3.2 bits) (default: none, --kv-type's)")  # fmt: skip
    p.add_argument("--kv-type", default=None,
                   help=f"K/V cache type of both sides: {', '.join(KV_TYPES)}, or K/V such as ott3/ott2 "
                   f"(default {default})")  # fmt: skip
    p.add_argument("-ctk", "--type-k", metavar="TYPE", help="K cache type, over --kv-type's (default: --kv-type's)")
    p.add_argument("-ctv", "--type-v", metavar="TYPE",
                   help="V cache type, over --kv-type's (ott* with ott*, kivi* with kivi*; default: "
                   "--kv-type's)")  # fmt: skip
    p.add_argument("--ott-layers", metavar="SPEC", default="",
                   help="K/V code widths of some layers of an ott cache, e.g. 15-24:4/3 (ott-gguf calibrate "
                   "chooses them; default: none, every layer at the types' widths)")  # fmt: skip
    p.add_argument("--ott-params", metavar=OTT_PARAMS, default="",
                   help="parameters of an ott cache, as llama.cpp's tools of this build take them (default "
                   "128,32,3,32,2,1,2,0)")  # fmt: skip


OTT_PARAMS = "G,R,OUTLIERS,AUX,NO_OUTLIER_LAYERS[,V_ROTATE[,K_MIX[,V_SYM[,K_YOUNG[,V_YOUNG]]]]]"


def parse_ott_params(text: str) -> dict[str, int | bool]:
    """--ott-params "128,64,3,32,2,1,1,1" -> OttConfig fields (the first five at least, in NATIVE_FIELDS order)."""
    from .kv_types import OttConfig

    names = OttConfig.NATIVE_FIELDS
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        raise ValueError(f"--ott-params expects {OTT_PARAMS} (integers), got {text!r}") from None
    if not 5 <= len(values) <= len(names):
        raise ValueError(f"--ott-params expects {OTT_PARAMS}, got {len(values)} values")
    out: dict[str, int | bool] = {}
    for name, value in zip(names, values, strict=False):
        if name == "k_mix":  # 0, 1 (3-bit keys) or 2 (2-bit keys too): kv_types.K_MIX_WIDTHS
            if value not in (0, 1, 2):
                raise ValueError(f"--ott-params: k_mix={value} must be 0, 1 or 2 (2: 2-bit keys too)")
            out[name] = bool(value) if value < 2 else value
        elif name in ("v_rotate", "v_sym"):
            if value not in (0, 1):
                raise ValueError(f"--ott-params: {name}={value} must be 0 or 1")
            out[name] = bool(value)
        else:
            out[name] = value
    return out


def _ott_config(args: argparse.Namespace, kv_type: str) -> OttConfig | None:
    """The OttConfig that --ott-layers and --ott-params ask for (None without them), checked before a model is
    fetched."""
    from .kv_types import OTT_KV_TYPES, OttConfig, resolve_kv_types

    params = getattr(args, "ott_params", "")
    if not args.ott_layers and not params:
        return None
    if resolve_kv_types(kv_type)[0] not in OTT_KV_TYPES:
        flag = "--ott-layers" if args.ott_layers else "--ott-params"
        raise ValueError(f"{flag} applies to the ott cache types ({', '.join(OTT_KV_TYPES)}), not {kv_type}")
    return OttConfig(layer_widths=args.ott_layers, **(parse_ott_params(params) if params else {}))


def _positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {n}")
    return n


def _temperature(value: str) -> float:
    try:
        t = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from None
    if not t >= 0:
        raise argparse.ArgumentTypeError(f"expected a temperature >= 0, got {value}")
    return t


def _chat_format(value: str) -> str:
    """A chat format llama-cpp-python has registered (checked here: Llama() takes any name and fails at the
    first chat)."""
    from .chat import chat_formats

    names = chat_formats()
    if value not in names:
        raise argparse.ArgumentTypeError(f"unknown chat format {value!r}; llama-cpp-python's: {', '.join(names)}")
    return value


def _add_llama_args(p: argparse.ArgumentParser, *, n_ctx: int, max_tokens: int) -> None:
    """chat's and generate's options, named as llama.cpp's tools name them."""
    cpus = os.cpu_count() or 1
    p.add_argument("-m", "--model", dest="model_opt", metavar="MODEL",
                   help=f"the model, as the MODEL argument takes it (default {models.DEFAULT_MODEL})")  # fmt: skip
    p.add_argument("-c", "--n-ctx", type=_positive_int, default=n_ctx,
                   help=f"context length in tokens, rounded up to a multiple of 256 (default {n_ctx})")  # fmt: skip
    p.add_argument("-n", "--max-tokens", type=_positive_int, default=max_tokens,
                   help=f"longest answer in tokens; an answer cut there ends with [max tokens] (default "
                   f"{max_tokens})")  # fmt: skip
    p.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", type=int, default=0, metavar="N",
                   help="layers whose weights and K/V cache go to the GPU; -1: all (default 0: all on the "
                   "CPU)")  # fmt: skip
    p.add_argument("-t", "--threads", type=_positive_int, metavar="N",
                   help=f"CPU threads, for decoding and for prompts (default: llama-cpp-python's, {max(cpus // 2, 1)} "
                   f"and {cpus} here)")  # fmt: skip
    p.add_argument("--temp", "--temperature", dest="temperature", type=_temperature, default=0.0,
                   help="sampling temperature (default 0: greedy, the same answer every time)")  # fmt: skip
    p.add_argument("-s", "--seed", type=int, default=0,
                   help="sampling seed, for a temperature above 0; -1: random (default 0)")  # fmt: skip
    p.add_argument("--chat-format", type=_chat_format, metavar="NAME",
                   help="llama-cpp-python's chat format, e.g. chatml, gemma, llama-3 (default: the GGUF's chat "
                   "template; a GGUF without one gets its architecture's format, said in one line)")  # fmt: skip
    p.add_argument("--verbose", action="store_true", help="show llama.cpp's log (default off)")


def _model_arg(args: argparse.Namespace) -> str | None:
    if args.model is not None and args.model_opt is not None:
        raise ValueError(f"the model is given twice ({args.model} and -m {args.model_opt}): give it once")
    return args.model if args.model is not None else args.model_opt


def _llama_kwargs(args: argparse.Namespace, kv_type: str, cfg: OttConfig | None) -> dict[str, object]:
    """ott_gguf.Llama's keywords for chat's and generate's options (the context length aside)."""
    from . import _lib

    if args.n_gpu_layers < -1:
        raise ValueError(f"-ngl {args.n_gpu_layers}: give a number of layers, or -1 for all")
    if args.n_gpu_layers != 0 and not _lib.gpu_devices():
        # llama.cpp would only log a warning (hidden without --verbose) and run every layer on the CPU
        info = _lib.build_info()
        raise ValueError(
            f"-ngl {args.n_gpu_layers}: llama.cpp finds no GPU device (this build: cuda {info.get('cuda')}, vulkan "
            f"{info.get('vulkan')}), so every layer would stay on the CPU; leave -ngl out here, or see the README's "
            "GPU sections for a GPU build"
        )
    kw: dict[str, object] = dict(kv_type=kv_type, ott_config=cfg, n_gpu_layers=args.n_gpu_layers, verbose=args.verbose)
    if args.threads is not None:
        kw.update(n_threads=args.threads, n_threads_batch=args.threads)
    if args.chat_format is not None:
        kw["chat_format"] = args.chat_format
    if not -1 <= args.seed < 2**32 - 1:
        raise ValueError(f"--seed {args.seed}: give 0 to {2**32 - 2}, or -1 for a random seed")
    if args.seed == -1:
        import random

        # llama-cpp-python derives each answer's sampling seed from this one, so "random" is chosen here
        kw["seed"] = random.SystemRandom().randrange(2**32 - 1)
    else:
        kw["seed"] = args.seed
    return kw


def cmd_generate(args: argparse.Namespace) -> int:
    from . import Llama, llama_ott_build_info
    from .chat import guessed_format_line, padded_n_ctx, truncation_marker

    kv_type = _kv_types(args)  # before fetching a model for nothing
    kw = _llama_kwargs(args, kv_type, None)
    path = _model_path(_model_arg(args))
    kw["kv_type"], kw["ott_config"] = _cache(args, path)
    llm = Llama(str(path), n_ctx=padded_n_ctx(args.n_ctx), **kw)
    note = guessed_format_line(llm)
    if note:
        print(note, file=sys.stderr)
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, temperature=args.temperature
    )
    choice = out["choices"][0]
    marker = truncation_marker(choice["finish_reason"], out["usage"]["prompt_tokens"], args.max_tokens, llm.n_ctx())
    print(choice["message"]["content"] + (f" {marker}" if marker else ""))
    tier = f"kv_tier={args.kv_tier}, " if args.kv_tier else ""
    print(f"[{path.name}, {tier}kv_type={llm.kv_type}, {llama_ott_build_info()}]", file=sys.stderr)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from . import chat

    kv_type = _kv_types(args)  # before fetching a model for nothing
    kw = _llama_kwargs(args, kv_type, None)
    path = _model_path(_model_arg(args))
    kw["kv_type"], kw["ott_config"] = _cache(args, path)
    return chat.run(path, n_ctx=args.n_ctx, system=args.system, max_tokens=args.max_tokens,
                    temperature=args.temperature, **kw)  # fmt: skip


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import server_command

    _kv_types(args)
    path = _model_path(args.model)
    kv_type, cfg = _cache(args, path)
    extra = list(args.passthrough)
    if not args.host.endswith(".sock") and "--reuse-port" not in extra:  # a unix socket; a port meant to be shared
        _check_port_free(args.host, args.port)  # the banner below says it serves: not before the port can be had
    cmd = server_command(path, kv_type=kv_type, ott_config=cfg, host=args.host, port=args.port, extra=extra,
                         page=True)  # fmt: skip
    print(f"ott-gguf: serving {path.name} with kv_type={kv_type} at http://{args.host}:{args.port}", flush=True)
    os.execv(cmd[0], cmd)
    return 0  # not reached


def _check_port_free(host: str, port: int) -> None:
    """Bind host:port as llama-server will (SO_REUSEADDR, as cpp-httplib sets it) and let go; ValueError naming
    the port when that fails, e.g. another server there."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as e:
        raise ValueError(f"cannot listen on {host}:{port}: {e}") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(addr)
        except OSError as e:
            raise ValueError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server there? --port "
                             "chooses another)") from None  # fmt: skip


def cmd_calibrate(args: argparse.Namespace) -> int:
    import shlex

    from .calibrate import calibrate
    from .tiers import QUALITY_PARAMS, calibration_target, model_sha256, write_calibration

    kv_type = _kv_types(args)
    if args.ott_layers:
        raise ValueError("calibrate chooses --ott-layers itself; give only --ott-params")
    if not args.ott_params and args.kv_type is None and not (args.type_k or args.type_v):
        args.ott_params = QUALITY_PARAMS  # the quality tier's pair and parameters: what `--kv-tier quality` reads
    cfg = _ott_config(args, kv_type)
    path = _model_path(args.model)
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        raise FileNotFoundError(f"--out {out}: no such directory {out.parent}")
    cal = calibrate(path, kv_type=kv_type, up=args.up, down=args.down, n_blocks=args.blocks, chunks=args.chunks,
                    n_ctx=args.n_ctx, threads=args.threads, budget=args.budget, max_bits=args.max_bits,
                    ott_config=cfg, log=lambda line: print(line, file=sys.stderr, flush=True),
                    max_minutes=args.max_minutes)  # fmt: skip
    print(cal.report())
    sha = model_sha256(path)
    command = shlex.join(["ott-gguf", *args.argv])
    record = cal.record(sha, command)
    target = out or calibration_target(record)
    write_calibration(target, record)
    print(f"calibration written to {target} (sha256 {sha[:12]}... of {path.name})")
    if cal.spec:
        params = f" --ott-params {args.ott_params}" if args.ott_params else ""
        fields = {f: getattr(cfg, f) for f in cfg.NATIVE_FIELDS} if cfg else {}
        py = {**fields, "layer_widths": cal.spec}
        print(f"use: -ctk {kv_type.split('/')[0]} -ctv {kv_type.split('/')[-1]}{params} --ott-layers {cal.spec}  "
              f"(Python: Llama(..., kv_type={kv_type!r}, ott_config={py!r}))")  # fmt: skip
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    for name in args.names or list(models.MODELS):
        print(f"{name}\t{models.fetch(name)}")
    return 0


def cmd_build_info(args: argparse.Namespace) -> int:
    from . import build_info, llama_ott_build_info, loaded_library_path

    print(llama_ott_build_info())
    print(f"libllama: {loaded_library_path()}")
    for k, v in build_info().items():
        print(f"{k}: {v}")
    return 0


# --- info, eval, bench: the computations are in ott_gguf.info/.evaluate/.bench; here they are formatted ------


def _kv_type_list(value: str) -> list[str]:
    """--kv-types: comma-separated names or K/V pairs (ott3/ott2), validated here so that a typo fails before any
    model is loaded."""
    from .kv_types import kv_pair_name, resolve_kv_types
    from .tiers import KV_TIERS

    try:
        names = [v.strip() if v.strip() in KV_TIERS else kv_pair_name(*resolve_kv_types(v.strip()))
                 for v in value.split(",") if v.strip()]  # fmt: skip
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if not names:
        raise argparse.ArgumentTypeError("no K/V cache type given")
    return list(dict.fromkeys(names))


def _int_list(value: str) -> list[int]:
    try:
        out = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not out or min(out) < 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers >= 0, got {value!r}")
    return out


def _table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned first column, the others right-aligned, columns as wide as their widest cell."""
    w = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return "\n".join(
        "  ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r)) for r in [header, *rows]
    )


def _progress(msg: str) -> None:
    print(f"ott-gguf: {msg}", file=sys.stderr, flush=True)


def _tiers_in(kv_types: list[str], path: Path) -> dict[str, tuple[str, OttConfig | None]]:
    """The tiers named among --kv-types, resolved for this model (each said in one line on stderr)."""
    from .tiers import KV_TIERS, resolve_tier

    out: dict[str, tuple[str, OttConfig | None]] = {}
    for name in kv_types:
        if name in KV_TIERS:
            tier = resolve_tier(name, path)
            print(tier.line, file=sys.stderr, flush=True)
            out[name] = (tier.kv_type, tier.ott_config)
    return out


def cmd_info(args: argparse.Namespace) -> int:
    import textwrap

    from .info import MEASURE_CTX, MIB, _allocated_bytes, formula_bytes_per_token, measure_kv_bytes, model_info
    from .kv_types import is_ott_kv_type

    path = _model_path(args.model)
    mi = model_info(path)
    hd = str(mi.head_dim_k) if mi.head_dim_k == mi.head_dim_v else f"{mi.head_dim_k} (K), {mi.head_dim_v} (V)"
    print(f"model: {path}")
    print(f"architecture: {mi.architecture}")
    print(f"n_layer: {mi.n_layer}")
    print(f"n_head: {mi.n_head}")
    print(f"n_head_kv: {'per layer' if mi.n_head_kv is None else mi.n_head_kv}")
    print(f"head_dim: {hd}")
    print(f"trained context: {mi.n_ctx_train or '?'}")
    if mi.sliding_window:
        print(f"sliding window: {mi.sliding_window}")
    print("ott2: supported" if not mi.ott2_problem else f"ott2: not supported: {mi.ott2_problem}")

    tiers = _tiers_in(args.kv_types, path)
    pair = {t: tiers[t][0] if t in tiers else t for t in args.kv_types}
    types = [t for t in args.kv_types if not (mi.ott2_problem and is_ott_kv_type(pair[t]))]
    # what ott_gguf.Llama (Python, chat, generate) allocates: llama-cpp-python keeps a sliding-window model's window
    # layers full size (swa_full); llama.cpp's tools (serve, bench) keep only the window
    measured = {k.kv_type: k for k in measure_kv_bytes(path, types, tiers=tiers, swa_full=None)}  # type: ignore[arg-type]
    windowed = {t: _allocated_bytes(path, pair[t], args.n_ctx, tiers[t][1] if t in tiers else None, False)[0]
                for t in types} if mi.sliding_window else {}  # fmt: skip
    budget = args.budget_mib * MIB
    header = ["kv_type", "bytes/token", "formula", "fixed MiB", f"MiB @ {args.n_ctx}"]
    if windowed:
        header.append(f"MiB @ {args.n_ctx} serve")
    header.append(f"max n_ctx in {args.budget_mib:g} MiB")
    rows = []
    for t in args.kv_types:
        k = measured.get(t)
        if k is None:
            rows.append([t, "-", "-", "-", "-", "not supported"])
            continue
        f = None if t in tiers else formula_bytes_per_token(mi, t)
        row = [t, f"{k.per_token:.0f}", "-" if f is None else f"{f:.0f}", f"{k.fixed / MIB:.2f}",
               f"{k.at(args.n_ctx) / MIB:.2f}"]  # fmt: skip
        if windowed:
            row.append(f"{windowed[t] / MIB:.2f}")
        rows.append([*row, str(k.longest_context(budget))])
    small, large = MEASURE_CTX
    print()
    print(_table(header, rows))
    note = (
        f"bytes/token and fixed: the K/V cache allocation of contexts of {small} and {large} tokens, one sequence, as "
        "the cache reports it through the C API (to the byte); formula: n_layer x "
        f"n_head_kv x (K + V head dims) x ggml bytes per element. MiB @ {args.n_ctx} and max n_ctx follow from "
        "bytes/token and fixed; the budget counts the K/V cache only (not the weights or compute buffers), max n_ctx "
        "is rounded down to a multiple of 256."
    )
    print("\n" + textwrap.fill(note, width=110))
    if windowed:
        print(textwrap.fill(
            f"{mi.architecture} has sliding-window layers: the table is what ott_gguf.Llama (Python, chat, generate) "
            "allocates, window layers as large as the others (llama-cpp-python's swa_full default); 'serve' is what "
            "llama.cpp's tools (ott-gguf serve, llama-server, llama-bench) allocate, window layers holding only the "
            "window. The ott caches keep only the window either way.", width=110))  # fmt: skip
    beyond = [t for t, k in measured.items() if mi.n_ctx_train and k.longest_context(budget) > mi.n_ctx_train]
    if beyond:
        print(textwrap.fill(
            f"note: the model was trained on {mi.n_ctx_train} tokens; the max n_ctx of {', '.join(beyond)} goes "
            "beyond it: the budget fits that much cache, but the model's quality past its trained context is not "
            "what it was trained for (llama.cpp warns when n_ctx exceeds it).", width=110))  # fmt: skip
    for t in measured:
        if is_ott_kv_type(pair[t]) and measured[t].parts:
            parts = ", ".join(f"{name} {b / MIB:.2f}" for name, b in measured[t].parts.items())
            print(f"{t} at {large} tokens (MiB): {parts}")
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    from .evaluate import REFERENCE, evaluate, import_pyplot, plot_eval
    from .kv_types import OttConfig, is_ott_kv_type

    path = _model_path(args.model)
    if args.plot:
        import_pyplot()  # fail before minutes of evaluation, not after
    text = Path(args.text).read_text(encoding="utf-8", errors="replace") if args.text else None
    tiers = _tiers_in(args.kv_types, path)
    rows = evaluate(path, args.kv_types, text=text, n_ctx=args.n_ctx, chunks=args.chunks, ubatch=args.ubatch,
                    n_threads=args.threads, progress=_progress, tiers=tiers)  # fmt: skip
    source = args.text or "the pinned llama.cpp docs"
    print(f"{path.name}: {rows[0].n_tokens} tokens of {source} ({rows[0].chunks} chunk(s) of up to {args.n_ctx}, "
          f"ubatch {args.ubatch}), each K/V type against the {REFERENCE} cache")  # fmt: skip
    header = ["kv_type", "mean KLD", "max KLD", "PPL", f"PPL / {REFERENCE}", f"top-1 = {REFERENCE}",
              f"bits/elem @ {args.n_ctx}"]  # fmt: skip
    # significant digits, not decimals: an exact 0 prints as 0, a tiny divergence does not round to it
    print(_table(header, [[r.kv_type, f"{r.mean_kld:.4g}", f"{r.max_kld:.4g}", f"{r.ppl:.3f}", f"{r.ppl_ratio:.4f}",
                           f"{100 * r.top1:.1f}%", "-" if r.bits_per_element is None else f"{r.bits_per_element:.2f}"]
                          for r in rows]))  # fmt: skip
    print(f"bits/elem: the bytes each cache allocated for {args.n_ctx} tokens (fp16 window, pools and any f16 window "
          "layers included) over the K and V elements of those tokens in every layer")  # fmt: skip
    ott = [t for t in args.kv_types if t in tiers or is_ott_kv_type(t)]
    cfg = OttConfig()
    if ott and args.n_ctx < cfg.R + cfg.G:
        # nothing is quantized below R + G positions: the ott rows then measure an fp16 cache, not their codes
        print(f"warning: at n_ctx {args.n_ctx} no group of {cfg.G} tokens is ever sealed (that takes {cfg.R + cfg.G} "
              f"positions): {', '.join(ott)} kept every token in fp16 here; use --n-ctx {cfg.R + cfg.G} or more",
              file=sys.stderr)  # fmt: skip
    if args.plot:
        plot_eval(rows, args.plot, title=f"{path.name}: {rows[0].n_tokens} tokens in {rows[0].chunks} chunk(s) of "
                  f"{args.n_ctx}, ubatch {args.ubatch}")  # fmt: skip
        print(f"plot: {args.plot}")
    return 0


BENCH_SPREAD = 0.2  # (max - min) / median of the rounds above which bench warns


def cmd_bench(args: argparse.Namespace) -> int:
    from .bench import bench, plot_bench
    from .evaluate import import_pyplot
    from .info import measure_kv_bytes

    path = _model_path(args.model)
    if args.plot:
        import_pyplot()  # fail before the benchmark, not after
    tiers = _tiers_in(args.kv_types, path)
    per_token = {k.kv_type: k.per_token for k in measure_kv_bytes(path, args.kv_types, tiers=tiers)}  # type: ignore[arg-type]
    try:
        rows = bench(
            path,
            args.kv_types,
            depths=args.depths,
            n_prompt=args.n_prompt,
            n_gen=args.n_gen,
            threads=args.threads,
            reps=args.reps,
            progress=_progress,
            tiers=tiers,
        )  # type: ignore[arg-type]
    except RuntimeError as e:
        print(f"ott-gguf: error: {e}", file=sys.stderr)
        return 1
    labels = list(dict.fromkeys(r.label for r in sorted(rows, key=lambda r: (r.depth, r.test))))
    cells = {(r.kv_type, r.label): f"{r.tokens_per_s:.1f}" + (f" ±{r.spread * 50:.0f}%" if args.reps > 1 else "")
             for r in rows}  # fmt: skip
    print(f"{path.name}: tokens/s by llama-bench, median of {args.reps} round(s) with the types interleaved"
          f"{' (± half the spread between rounds)' if args.reps > 1 else ''}, flash attention on; pp = prefill, "
          "tg = decode, @ = tokens already in the cache")  # fmt: skip
    table = [[t, f"{per_token[t]:.0f}", *(cells.get((t, lb), "-") for lb in labels)] for t in args.kv_types]
    print(_table(["kv_type", "KV B/token", *labels], table))
    if args.reps == 1:
        print("warning: one round: no spread to tell a busy or throttling machine from a real difference; use -r 3 or "
              "more to compare types", file=sys.stderr)  # fmt: skip
    wide = [f"{r.kv_type} {r.label} ({100 * r.spread:.0f}%)" for r in rows if r.spread > BENCH_SPREAD]
    if wide:
        print(f"warning: the rounds differ by more than {100 * BENCH_SPREAD:.0f}% of the median for "
              f"{', '.join(wide)}: the machine was busy or changing speed; run again when it is idle, or with more "
              "rounds", file=sys.stderr)  # fmt: skip
    if args.plot:
        rounds = f"median of {args.reps} round(s)" + (", bars: slowest to fastest" if args.reps > 1 else ", ONE round")
        plot_bench(rows, args.plot, per_token, title=f"{path.name}, llama-bench, {rounds}")
        print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    from .info import INFO_KV_TYPES

    ap = argparse.ArgumentParser(prog="ott-gguf", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    known = f"GGUF path or one of {', '.join(models.MODELS)}"
    g = sub.add_parser("generate", help="chat-complete one prompt with a GGUF model (greedy by default)")
    g.add_argument("model", nargs="?", metavar="MODEL", help=f"{known} (default {models.DEFAULT_MODEL})")
    g.add_argument("prompt")
    _add_kv_type_args(g, "ott2")
    _add_llama_args(g, n_ctx=2048, max_tokens=64)
    g.set_defaults(fn=cmd_generate)

    c = sub.add_parser("chat", help="chat in the terminal, streaming, with the K/V cache's size after each answer")
    c.add_argument("model", nargs="?", metavar="MODEL", help=f"{known} (default {models.DEFAULT_MODEL})")
    _add_kv_type_args(c, "ott2")
    _add_llama_args(c, n_ctx=4096, max_tokens=512)
    c.add_argument("--system", help="system prompt (default: the chat template's own)")
    c.set_defaults(fn=cmd_chat)

    s = sub.add_parser(
        "serve", help="run the patched llama-server (OpenAI-compatible); flags after -- go to llama-server"
    )
    s.add_argument("model", help="GGUF path or a known model name")
    _add_kv_type_args(s, "ott2")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.set_defaults(fn=cmd_serve)

    k = sub.add_parser("calibrate", help="choose K/V code widths per layer for a model at the bytes of a K/V pair",
                       description="Choose K/V code widths per layer on calibration text and write them where "
                       "--kv-tier quality finds them (docs/kv-tiers.md). Without --kv-type/-ctk/-ctv/--ott-params it "
                       "calibrates the quality tier: ott3/ott2 --ott-params 128,64,3,32,2,1,1,1.")  # fmt: skip
    k.add_argument("model", help="GGUF path or a known model name")
    _add_kv_type_args(k, "ott3/ott2", tier=False)
    k.add_argument("--up", default="3/3", help="K/V bits of a widened block (default 3/3)")
    k.add_argument(
        "--down",
        default="2/2",
        help="K/V bits of a narrowed block (default 2/2; the base pair's own "
        "widths widen only, as for ott2: --kv-type ott2 --up 3/2 --max-bits 2.8)",
    )
    k.add_argument("--blocks", type=int, default=10, help="contiguous blocks of layers (default 10)")
    k.add_argument("--budget", type=float, default=1.0,
                   help="code bits allowed, as a fraction of the base pair's (default 1: a cache no larger; "
                        "e.g. 0.99 for a smaller one)")  # fmt: skip
    k.add_argument("--max-bits", type=float, default=None,
                   help="or: bits per K/V element allowed at 8k tokens, by the caches' bytes (e.g. 3.2)")  # fmt: skip
    k.add_argument("--chunks", type=int, default=2, help="llama-perplexity chunks of calibration text (default 2)")
    k.add_argument(
        "--n-ctx",
        type=int,
        default=None,
        help="tokens per chunk (default: the longest of 8192/4096/2048 the model was trained for whose "
        "estimated time fits --max-minutes; a calibration holds best at the context it was made at)",
    )
    k.add_argument("--max-minutes", type=float, default=60.0,
                   help="time allowed when choosing the context (default 60; the estimate comes from short timed "
                        "runs and is printed before the calibration starts)")  # fmt: skip
    k.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="CPU threads")
    k.add_argument("--out", metavar="FILE",
                   help="write the calibration here (default: the user cache, <cache>/calibrations/<sha256>.json, "
                   "where --kv-tier quality finds it; a file named <model>.ott-calib.json next to the model is "
                   "found too)")  # fmt: skip
    k.set_defaults(fn=cmd_calibrate)

    m = sub.add_parser("models", help="fetch the test models into the cache and print their paths")
    m.add_argument("names", nargs="*")
    m.set_defaults(fn=cmd_models)

    b = sub.add_parser("build-info", help="what native build is installed and loaded")
    b.set_defaults(fn=cmd_build_info)

    i = sub.add_parser("info", help="attention shape, ott support, K/V bytes per token and longest context per type")
    i.add_argument("model", help=known)
    i.add_argument("--budget-mib", type=float, default=1024, help="memory for the K/V cache, MiB (default 1024)")
    i.add_argument("--n-ctx", type=int, default=4096, help="also show each cache's size at this context length")
    i.add_argument("--kv-types", type=_kv_type_list, default=",".join(INFO_KV_TYPES),
                   help="comma-separated; K/V for a pair, e.g. ott3/ott2")  # fmt: skip
    i.set_defaults(fn=cmd_info)

    e = sub.add_parser("eval", help="KL divergence, perplexity ratio and top-1 agreement of K/V types vs f16")
    e.add_argument("model", help=known)
    e.add_argument("--text", help="UTF-8 text file (default: the pinned llama.cpp docs)")
    e.add_argument("--n-ctx", type=int, default=2048,
                   help="tokens per chunk, each from an empty cache (default 2048: most tokens then attend to sealed, "
                   "quantized groups, as in a long chat; at 512 most stay in the fp16 window)")  # fmt: skip
    e.add_argument("--chunks", type=int, default=4, help="at most this many chunks")
    e.add_argument("--ubatch", type=int, default=16, help="tokens per decode call (1: token by token)")
    e.add_argument("--kv-types", type=_kv_type_list, default="f16,q8_0,q4_0,kivi2,ott2",
                   help="comma-separated; K/V for a pair, e.g. ott3/ott2")  # fmt: skip
    e.add_argument("--threads", type=int, help="CPU threads (default: llama-cpp-python's)")
    e.add_argument("--plot", help="write a bar chart (PNG) here")
    e.set_defaults(fn=cmd_eval)

    n = sub.add_parser("bench", help="prefill/decode tokens/s vs context depth per K/V type (llama-bench)")
    n.add_argument("model", help=known)
    n.add_argument("--depths", type=_int_list, default="0,512,2048", help="tokens in the cache before timing")
    n.add_argument("--kv-types", type=_kv_type_list, default="f16,q8_0,q4_0,ott2",
                   help="comma-separated; K/V for a pair, e.g. ott3/ott2")  # fmt: skip
    n.add_argument("-p", "--n-prompt", type=int, default=512, help="prompt tokens timed (prefill)")
    n.add_argument("-n", "--n-gen", type=int, default=64, help="generated tokens timed (decode)")
    n.add_argument("-r", "--reps", type=int, default=3, help="rounds, every type once per round (median, spread)")
    n.add_argument("--threads", type=int, help="CPU threads (default: llama-bench's)")
    n.add_argument("--plot", help="write tokens/s vs depth (PNG) here")
    n.set_defaults(fn=cmd_bench)

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        cmd = next((a for a in argv[:i] if not a.startswith("-")), None)
        if cmd == "serve":  # everything after -- goes to llama-server as it is
            argv, passthrough = argv[:i], argv[i + 1 :]
        elif cmd in sub.choices:  # elsewhere it would be dropped or misread: refused
            sub.choices[cmd].error(f"'--' passes options to llama-server, in 'ott-gguf serve' only; {cmd} takes its "
                                   f"options itself (ott-gguf {cmd} -h)")  # fmt: skip
    args = ap.parse_args(argv)
    args.passthrough = passthrough
    args.argv = argv
    try:
        return int(args.fn(args))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"ott-gguf: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
