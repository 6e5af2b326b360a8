"""`ott-gguf` command line: generate, serve, models, build-info."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import models


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


def cmd_generate(args: argparse.Namespace) -> int:
    from . import Llama, llama_ott_build_info

    path = _model_path(args.model)
    llm = Llama(str(path), kv_type=args.kv_type, n_ctx=args.n_ctx, seed=0, verbose=args.verbose)
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": args.prompt}], max_tokens=args.max_tokens, temperature=0.0
    )
    print(out["choices"][0]["message"]["content"])
    print(f"[{path.name}, kv_type={llm.kv_type}, {llama_ott_build_info()}]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from .server import server_command, server_env

    path = _model_path(args.model)
    extra = list(args.passthrough)
    cmd = server_command(path, kv_type=args.kv_type, host=args.host, port=args.port, extra=extra)
    print(f"ott-gguf: serving {path.name} with kv_type={args.kv_type} at http://{args.host}:{args.port}", flush=True)
    os.execve(cmd[0], cmd, server_env(args.kv_type))
    return 0  # not reached


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


def main(argv: list[str] | None = None) -> int:
    from .kv_types import KV_TYPES

    ap = argparse.ArgumentParser(prog="ott-gguf", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    g = sub.add_parser("generate", help="chat-complete one prompt greedily with a GGUF model")
    g.add_argument("prompt")
    g.add_argument("--model", help=f"GGUF path or one of {', '.join(models.MODELS)} (default {models.DEFAULT_MODEL})")
    g.add_argument("--kv-type", default="f16", help=f"K/V cache type: {', '.join(KV_TYPES)}")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--n-ctx", type=int, default=2048)
    g.add_argument("--verbose", action="store_true", help="show llama.cpp's log")
    g.set_defaults(fn=cmd_generate)

    s = sub.add_parser(
        "serve", help="run the patched llama-server (OpenAI-compatible); flags after -- go to llama-server"
    )
    s.add_argument("model", help="GGUF path or a known model name")
    s.add_argument("--kv-type", default="f16")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8080)
    s.set_defaults(fn=cmd_serve)

    m = sub.add_parser("models", help="fetch the test models into the cache and print their paths")
    m.add_argument("names", nargs="*")
    m.set_defaults(fn=cmd_models)

    b = sub.add_parser("build-info", help="what native build is installed and loaded")
    b.set_defaults(fn=cmd_build_info)

    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:  # everything after -- goes to llama-server as it is
        i = argv.index("--")
        argv, passthrough = argv[:i], argv[i + 1 :]
    args = ap.parse_args(argv)
    args.passthrough = passthrough
    try:
        return int(args.fn(args))
    except (ValueError, NotImplementedError, FileNotFoundError) as e:
        print(f"ott-gguf: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
