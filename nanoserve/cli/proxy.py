"""`python -m nanoserve proxy` (chapter 17): one OpenAI endpoint in front of a prefill and a decode engine.

    python -m nanoserve serve --kv-role prefill --weights fp32 --port 8100
    python -m nanoserve serve --kv-role decode --weights fp32 --port 8200
    python -m nanoserve proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200 --port 8000
"""

import sys


def register(sub):
    p = sub.add_parser("proxy", help="join a prefill and a decode engine behind one OpenAI endpoint (chapter 17)")
    p.add_argument("--prefill", required=True, metavar="URL", help="the engine serving --kv-role prefill")
    p.add_argument("--decode", required=True, metavar="URL", help="the engine serving --kv-role decode")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=run)


def run(args):
    import uvicorn

    from nanoserve.cli.serve import listen
    from nanoserve.disagg.proxy import build_proxy

    for flag, url in (("--prefill", args.prefill), ("--decode", args.decode)):
        if not url.startswith(("http://", "https://")):
            print(f"error: {flag} must be an http:// URL, got {url!r}", file=sys.stderr)
            return 2
    sock, problem = listen(args.host, args.port)
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    app = build_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/"))
    print(f"nanoserve proxy: http://{args.host}:{sock.getsockname()[1]} -> prefill {args.prefill}, "
          f"decode {args.decode}", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level=args.log_level)).run(sockets=[sock])
    return 0
