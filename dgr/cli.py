"""``python -m dgr``: the command line (run the demo, and the tools built on the SDK)."""

from __future__ import annotations

import argparse
import sys
import time

__all__ = ["main"]

DEFAULT_PROMPT = "Explain in two sentences why the sky is blue."


def _engine_settings(args) -> dict:
    return dict(n_ctx=args.ctx, n_threads=args.threads, n_ubatch=args.ubatch,
                flash_attn=args.flash_attn == "on")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, default=1, help="CPU threads per stage (default 1)")
    p.add_argument("--ubatch", type=int, default=64, help="tokens per compute chunk (default 64)")
    p.add_argument("--ctx", type=int, default=1024, help="context tokens per session (default 1024)")
    p.add_argument("--flash-attn", choices=["on", "off"], default="on")


def _cmd_run(args) -> int:
    from . import errors, models
    from .chain import LocalChain, generate, split_layers
    from .engine import Engine
    from .sampling import SamplingParams

    try:
        model = args.model or str(models.path(models.DEFAULT_MODEL))
        settings = _engine_settings(args)
        print(f"[dgr] loading {model}", file=sys.stderr)
        whole = Engine(model, **settings)
        ranges = split_layers(whole.n_layer, args.stages)
        print(f"[dgr] {args.stages} stages over {whole.n_layer} layers: "
              + " ".join(f"[{a},{b})" for a, b in ranges), file=sys.stderr)
        chain = LocalChain(model, ranges, **settings) if args.stages > 1 else whole
        text = args.prompt
        if args.chat:
            text = (f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")
        prompt = chain.tokenize(text, add_special=True, parse_special=True)
        sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, seed=args.seed)
        print(f"[dgr] prompt: {args.prompt!r} ({len(prompt)} tokens)\n", file=sys.stderr)
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = None
        shown = ""
        for tok in generate(chain, prompt, max_tokens=args.max_tokens, sampling=sampling):
            if t_first is None:
                t_first = time.perf_counter()
            out.append(tok)
            full = chain.detokenize(out)
            sys.stdout.write(full[len(shown):])
            sys.stdout.flush()
            shown = full
        t1 = time.perf_counter()
        print()
        ref = list(generate(whole, prompt, max_tokens=args.max_tokens, sampling=sampling))
        same = ref == out
        n_dec = max(len(out) - 1, 1)
        print(f"\n[dgr] {len(out)} tokens; time to first token {(t_first or t1) - t0:.3f} s; "
              f"decode {n_dec / max(t1 - (t_first or t1), 1e-9):.1f} tokens/s", file=sys.stderr)
        print(f"[dgr] matches the whole model: {'yes' if same else 'NO'}", file=sys.stderr)
        return 0 if same else 1
    except errors.DgrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m dgr",
        description="dgr: a distributed GGUF runtime. One model is split into contiguous layer "
                    "ranges, each served by a stage; a route runs a generation across them.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser(
        "run", help="demo: generate with the default model split into stages, and check the "
                    "output against the whole model",
        description="Generate with a model split into N stages and check that the output equals "
                    "the whole model's. Fetches the default model on first use.")
    r.add_argument("--model", help="GGUF path (default: the registry's default model, SmolLM2-135M)")
    r.add_argument("--stages", type=int, default=3, help="number of stages (default 3)")
    r.add_argument("--prompt", default=DEFAULT_PROMPT)
    r.add_argument("--no-chat", dest="chat", action="store_false",
                   help="send the prompt raw instead of in the model's chat format")
    r.add_argument("--max-tokens", type=int, default=64)
    r.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    r.add_argument("--top-k", type=int, default=0)
    r.add_argument("--top-p", type=float, default=1.0)
    r.add_argument("--seed", type=int, default=0)
    _add_engine_args(r)
    r.set_defaults(func=_cmd_run)
    args = ap.parse_args(argv)
    return args.func(args)
