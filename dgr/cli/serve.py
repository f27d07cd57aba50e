"""``python -m dgr serve``: the OpenAI-compatible HTTP front (``dgr.serve``) on uvicorn.

With no arguments it starts the local 3-stage cluster on the default model (as ``python -m
dgr run`` does) and serves it on http://127.0.0.1:8000/v1; ``--route host:port,...`` serves
workers that are already running instead. The chat template comes from the model's GGUF
(``--model``; with ``--route`` and no ``--model``, only ``/v1/completions`` is served).

It listens beyond loopback only with API keys, or with ``--insecure`` (docs/security.md).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import time

from dgr import errors
from dgr.cli.console import say
from dgr.cli.speculate import add_speculate_arguments
from dgr.protocol import settings as engine_settings
from dgr.transport.security import is_loopback

__all__ = ["add_serve_parser"]


def add_serve_parser(sub) -> None:
    s = sub.add_parser(
        "serve", help="serve a route over the OpenAI HTTP API (chat, completions, streaming)",
        description="Serve a route over the OpenAI-compatible HTTP API: GET /v1/models, POST "
                    "/v1/chat/completions and /v1/completions (stream: true for server-sent "
                    "events), GET /health, GET /metrics and a status page at GET /. "
                    "Without --route it starts N local workers on the model (default: the "
                    "registry's default model, 3 stages) and stops them on exit. Point any "
                    "OpenAI client at "
                    "http://HOST:PORT/v1 (any API key, unless --api-key-file or DGR_API_KEYS "
                    "sets them). A --host beyond loopback needs API keys or --insecure.")
    s.add_argument("--model", help="GGUF path: the model of the local workers, and the source "
                                   "of the chat template (default: the registry's default)")
    s.add_argument("--route", help="comma-separated host:port of running workers, in any order "
                                   "(default: start local workers)")
    s.add_argument("--stages", type=int, default=3, help="local workers (default 3)")
    s.add_argument("--splits", help="interior split layers of the local workers, e.g. 10,20, "
                                    "or cost: --stages ranges balanced by each layer's time "
                                    "measured on this machine at the route's batch")
    s.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only). Any "
                        "other than loopback needs API keys (--api-key-file, DGR_API_KEYS) "
                        "or --insecure")
    s.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    s.add_argument("--chat-template-file", metavar="FILE",
                   help="a Jinja chat template to render chat requests with instead of the "
                        "GGUF's own (llama-server's flag; for a model without one, or to "
                        "override it)")
    s.add_argument("--model-name", help="the model id clients send (default: the GGUF's file "
                                        "name without .gguf)")
    s.add_argument("--queue-timeout", type=float, default=600.0,
                   help="seconds a request may wait in the queue for a free slot before a 503 "
                        "with Retry-After (default 600: agents' sub-agents queue behind each "
                        "other)")
    s.add_argument("--max-queue", type=int, default=128, metavar="N",
                   help="requests that may wait for a free slot at once, served in arrival "
                        "order; one more gets a 429 with Retry-After at once (default 128; 0: "
                        "no queue)")
    s.add_argument("--start-timeout", type=float, default=180.0,
                   help="seconds to wait for the local workers to listen")
    s.add_argument("--api-key-file", metavar="FILE",
                   help="API keys, one a line, as KEY or NAME KEY (the name, not the "
                        "key, is what logs and metrics show; a bare key is named key-N): every "
                        "request but /health and the status page's files then needs "
                        "'Authorization: Bearer KEY' (401 otherwise); also read from "
                        "DGR_API_KEYS (comma-separated). Default: no key needed. Keys are "
                        "never logged: docs/security.md")
    s.add_argument("--max-requests-per-key", type=int, default=None, metavar="N",
                   help="generation requests (chat, completions, messages, responses, "
                        "embeddings; a stream until it ends) one API key may have in flight; "
                        "one more gets a 429 with Retry-After at once. Default: half the "
                        "route's slots, at least 1 (on a route of 2 slots or more one key "
                        "never holds them all). 0: no cap. Applies only with API keys: "
                        "without them there is no key to count")
    s.add_argument("--prompt-cache", type=int, default=2, metavar="N",
                   help="ended sessions kept, caches on every stage and all, for later "
                        "requests of the same API key whose prompts begin the same way: they "
                        "prefill only what differs, with the bits a fresh prefill gives "
                        "(whole n_ubatch chunks, and partial chunks' rows where every stage "
                        "measured them exact). Each kept session holds a slot "
                        "until a request needs it or --prompt-cache-ttl passes. Default: 2; "
                        "0: off")
    s.add_argument("--pooling", choices=["mean", "last", "cls"], default=None,
                   help="how /v1/embeddings pools a prompt's final hidden rows (each vector "
                        "then scaled to unit length). Default: the GGUF's pooling type where it "
                        "has one, else last (the token that saw the whole prompt)")
    s.add_argument("--prompt-cache-ttl", type=float, default=30.0, metavar="S",
                   help="seconds a kept session may stay idle (default: 30)")
    s.add_argument("--no-prefix-store", dest="prefix_store", action="store_false",
                   help="do not use the stages' prefix stores: by default a session closed "
                        "after a request that ended well leaves its caches on every stage "
                        "(each worker's --prefix-entries: its whole n_ubatch chunks, and "
                        "the rows after them the prompt cache would reuse), and a new "
                        "request of the same API key whose prompt begins with them adopts "
                        "them instead of prefilling them (another front on the same workers "
                        "too)")
    s.add_argument("--mmproj", metavar="GGUF",
                   help="the model's projector (its mmproj GGUF): the first local worker "
                        "runs it (libmtmd, on its device), and chat requests may hold images "
                        "(OpenAI image_url, Anthropic image blocks, Responses input_image) "
                        "and, where it takes audio, input_audio; docs/media.md. With --route, "
                        "start the first worker with --mmproj instead")
    s.add_argument("--mmproj-on", choices=["first", "front"], default="first",
                   help="where the projector runs: beside the first stage, on its device "
                        "(default: the encoder wants the accelerator that stage has, and "
                        "reads the model it holds), or in a worker of its own on this "
                        "machine (front: for a first stage without room for it; needs "
                        "--model, also with --route); docs/media.md")
    s.add_argument("--max-media", type=int, default=8, metavar="N",
                   help="images and audio clips one request may hold (default 8)")
    s.add_argument("--max-media-bytes", type=int, default=5 << 20, metavar="B",
                   help="bytes one image or audio clip may have (default 5 MiB)")
    s.add_argument("--max-image-pixels", type=int, default=8000 * 8000, metavar="N",
                   help="pixels (width x height) an image may have, read from its header "
                        "before it is decoded (default 64,000,000)")
    s.add_argument("--media-url-host", action="append", metavar="HOST",
                   help="a host whose http(s) image URLs the server fetches (repeat, or "
                        "comma-separate); without it only data: URLs are taken, and no "
                        "request makes the server fetch from an address it chose")
    s.add_argument("--insecure", action="store_true",
                   help="allow a --host beyond loopback without API keys (a warning is "
                        "logged): anyone who can reach the port may use it")
    s.add_argument("--relay", choices=["auto", "on", "off"], default="auto",
                   help="direct relay over the workers' data plane (default: where it applies)")
    add_speculate_arguments(s)
    engine_settings.add_arguments(s)
    s.set_defaults(func=_cmd_serve)


#: llama.cpp's ``LLAMA_POOLING_TYPE_*`` values of the GGUF key ``<arch>.pooling_type``
_GGUF_POOLING = {1: "mean", 2: "cls", 3: "last"}


def gguf_pooling(model: str) -> str | None:
    """The pooling type the GGUF at ``model`` declares (``mean``, ``cls`` or ``last``), None
    where it declares none (a causal language model) or another (rank)."""
    from dgr.artifacts.gguf import read_header

    kv = read_header(model).kv
    return _GGUF_POOLING.get(kv.get(f"{kv.get('general.architecture', '')}.pooling_type"))


def _cmd_serve(args) -> int:
    import uvicorn

    from dgr import errors

    checked = _checked(args)
    if isinstance(checked, int):
        return checked
    api_keys, front = checked
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="[dgr.serve] %(levelname)s %(message)s")
    if not api_keys and not is_loopback(args.host):
        logging.getLogger("dgr.serve").warning(
            "--insecure: serving %s without API keys; anyone who can reach the port may use "
            "it", args.host)
    try:
        custom = _template_file(args)  # a bad file is refused before any worker starts
    except errors.DgrError as e:
        return errors.report(e)
    cluster = encoder = None
    try:
        if args.route:
            model, endpoints = args.model, [e for e in args.route.split(",") if e]
        else:
            model, endpoints, cluster = _start_cluster(args)
        name = args.model_name or (os.path.basename(model).removesuffix(".gguf") if model
                                   else "dgr")
        if args.mmproj_on == "front":
            encoder = _start_encoder(args, model)
        app = _app(args, model, name, endpoints, api_keys, front, custom,
                   encoder=encoder.endpoint if encoder else "")
        _say_serving(args, name, len(endpoints), api_keys)
        uvicorn.run(app, host=args.host, port=args.port, log_level="info")
        return 0
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except errors.DgrError as e:
        return errors.report(e)
    finally:
        if encoder is not None:
            encoder.stop()
        if cluster is not None:
            _stop(cluster)


def _start_encoder(args, model: str):
    """``--mmproj-on front``: a worker on this machine of the model's first layer with the
    projector, which encodes the route's media and computes no step."""
    from dgr.core.engine import Engine
    from dgr.worker.process import WorkerProcess

    n_layer = Engine(model, n_ctx=64).n_layer
    settings = dict(engine_settings.from_args(args), n_ctx=64, n_slots=1)
    w = WorkerProcess(model, (0, 1) if n_layer > 1 else None, settings=settings,
                      args=["--mmproj", args.mmproj])
    w.start()
    try:
        say(f"projector {os.path.basename(args.mmproj)} on this machine: {w.wait_listening()}")
    except BaseException:
        w.stop()
        raise
    return w


def _checked(args):
    """Every setting checked before a worker starts: ``(api_keys, front settings)``, or the
    exit status of a refusal (its reason printed)."""
    from dgr.serve.auth import load_keys
    from dgr.serve.settings import ServeSettings

    try:
        api_keys = load_keys(args.api_key_file, os.environ.get("DGR_API_KEYS"))
    except (OSError, ValueError) as e:
        print(f"error: API keys: {e}", file=sys.stderr)
        return 2
    try:
        front = ServeSettings.from_args(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.route and engine_settings.given(args):
        print(f"error: {', '.join(engine_settings.given(args))} set the engines of the workers "
              "serve starts without --route; the workers of a --route keep the settings they "
              "were started with (python -m dgr.worker takes the same flags)", file=sys.stderr)
        return 2
    if args.route and args.mmproj and args.mmproj_on == "first":
        print("error: --mmproj starts the projector beside the first local worker; the "
              "workers of a --route keep theirs: start the first with python -m dgr.worker "
              "--mmproj GGUF (or run it here: --mmproj-on front --model M)", file=sys.stderr)
        return 2
    if args.mmproj_on == "front" and not (args.mmproj and (args.model or not args.route)):
        print("error: --mmproj-on front runs the projector here: give --mmproj GGUF (and "
              "--model M with --route)", file=sys.stderr)
        return 2
    if args.mmproj and not os.path.isfile(args.mmproj):
        print(f"error: --mmproj {args.mmproj}: no such file", file=sys.stderr)
        return 2
    if not api_keys and not is_loopback(args.host) and not args.insecure:
        print(f"error: --host {args.host} is beyond loopback and no API key is configured: "
              "give --api-key-file FILE or DGR_API_KEYS, or --insecure to serve anyone who "
              "can reach the port", file=sys.stderr)
        return 2
    return api_keys, front


def _start_cluster(args):
    """Start the local workers (``--model``, ``--stages``/``--splits``, the engine flags):
    ``(model path, endpoints, the LocalCluster)``."""
    from dgr.artifacts import models
    from dgr.cli.interrupts import install_interrupts
    from dgr.control.layercost import ranges_of
    from dgr.core.engine import Engine
    from dgr.worker.process import LocalCluster

    install_interrupts()
    model = args.model or str(models.path(models.DEFAULT_MODEL))
    settings = engine_settings.from_args(args)
    n_layer = Engine(model, n_ctx=64).n_layer
    # cost: balanced for a full route, every slot busy, in ring groups of slots/stages rows
    ranges = ranges_of(args.splits, args.stages, n_layer, model, settings,
                       batch=-(-settings["n_slots"] // max(args.stages, 1)))
    say(f"model {model}; {len(ranges)} stage(s): " + " ".join(f"[{a},{b})" for a, b in ranges))
    beside = args.mmproj and args.mmproj_on == "first"
    cluster = LocalCluster(model, [None if r == (0, n_layer) else r for r in ranges],
                           settings=settings,
                           first_args=["--mmproj", args.mmproj] if beside else ())
    t0 = time.monotonic()
    try:
        endpoints = cluster.start(
            timeout=args.start_timeout,
            progress=lambda i, n, msg: say(f"{msg} ({time.monotonic() - t0:.1f} s)"))
    except BaseException:  # a worker failed to start, or Ctrl-C: stop the others
        _stop(cluster)
        raise
    return model, endpoints, cluster


def _stop(cluster) -> None:
    codes = cluster.stop()
    say(f"workers stopped (exit status {', '.join(map(str, codes))})")


def _template_file(args) -> str | None:
    """The text of ``--chat-template-file`` (None without it), compiled once to check it."""
    if not args.chat_template_file:
        return None
    from dgr.serve.templates import ChatTemplate

    try:
        with open(args.chat_template_file, encoding="utf-8") as f:
            source = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise errors.InvalidArgument(
            f"--chat-template-file {args.chat_template_file}: {getattr(e, 'strerror', e)}"
        ) from None
    ChatTemplate(source=source, name=os.path.basename(args.chat_template_file)).check()
    return source


def _app(args, model: str | None, name: str, endpoints: list[str], api_keys, front,
         custom: str | None = None, encoder: str = ""):
    """The front's ASGI app over a route of ``endpoints``, with the model's chat template
    (``custom``: ``--chat-template-file``'s instead)."""
    from dgr.driver.route import AsyncRoute, RouteConfig
    from dgr.serve.app import create_app

    from dgr.serve.templates import ChatTemplate

    template = None
    if model:
        template = ChatTemplate.from_gguf(model)  # its BOS/EOS, whatever the template
    if custom is not None:
        template = dataclasses.replace(template or ChatTemplate(source=None), source=custom,
                                       tool_use=None,
                                       name=os.path.basename(args.chat_template_file))
    elif model and not template.available:
        say(f"{os.path.basename(model)} has no chat template: /v1/chat/completions answers "
            "400; /v1/completions works (or give one: --chat-template-file)")
        template = None
    if not args.pooling:
        front = front.with_(pooling=(model and gguf_pooling(model)) or "last")
    config = RouteConfig.from_args(args, **({"encoder": encoder} if encoder else {}))
    return create_app(AsyncRoute(endpoints, config=config), model=name,
                      template=template, api_keys=api_keys, settings=front)


def _say_serving(args, name: str, n_stages: int, api_keys) -> None:
    cap = args.max_requests_per_key
    cap_text = "half the route's slots" if cap is None else "no cap" if cap == 0 else str(cap)
    say(f"API keys: {len(api_keys)} ({', '.join(k.name for k in api_keys)}; "
        f"Authorization: Bearer); requests in flight per key: {cap_text}" if api_keys
        else "API keys: none; anyone who can reach the port may use it")
    say(f"serving '{name}' over {n_stages} stage(s) on http://{args.host}:{args.port}/v1; "
        f"status page http://{args.host}:{args.port}/ (Ctrl-C stops)")
