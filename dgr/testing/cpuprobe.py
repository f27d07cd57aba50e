"""``python -m dgr.testing.cpuprobe MODEL``: what this process's build computes on this CPU.

It prints one JSON object: the build's CPU variant and what ggml's CPU code was compiled for,
then the greedy tokens of the whole model and of a two-stage split (one process, as
``dgr.core.local`` chains them), and a sha256 of every logits row. Run with one build under an
emulated older CPU (``qemu-x86_64 -cpu Haswell``) and natively, it shows the build runs there
and computes the same bits; against another variant's build, whether the tokens agree.
It needs only the installed package (no llama.cpp tree), so a wheel's environment runs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys

__all__ = ["probe", "main"]


def probe(model: str, *, prompt: tuple[int, ...] = (1, 17, 42, 99, 7, 30, 5, 64),
          max_tokens: int = 8) -> dict:
    from dgr._core import BUILD_INFO, cpu_features
    from dgr.core import Engine, LocalChain, generate_local

    out = {"cpu_variant": BUILD_INFO.get("cpu_variant", "native"), "cpu_compiled": cpu_features()}
    whole = Engine(model, n_threads=1)
    n_layer = int(whole.n_layer)
    runs = {"whole": whole, "split": LocalChain(model, [(0, n_layer // 2), (n_layer // 2, n_layer)],
                                                n_threads=1)}
    for name, engine in runs.items():
        toks, rows = generate_local(engine, list(prompt), max_tokens=max_tokens, logits=True,
                                    stop_on_eog=False)
        h = hashlib.sha256()
        for r in rows:
            h.update(r.tobytes())
        out[name] = {"tokens": [int(t) for t in toks], "logits_sha256": h.hexdigest()}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dgr.testing.cpuprobe", description=__doc__.split(
        "\n\n")[0])
    ap.add_argument("model", help="a GGUF model (a tiny fixture: this may run under emulation)")
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args(argv)
    json.dump(probe(args.model, max_tokens=args.max_tokens), sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
