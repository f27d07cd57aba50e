"""A scripted parity run: dgr's penalties and logit bias against the pinned llama-server.

    python benches/sampling_parity.py [--tokens 32] [--json out.json]

For each case below, greedy (temperature 0) on the registry's default model: the tokens of
dgr's whole-model reference (``dgr.core.local.generate_local``, which a split route matches
token for token: tests/integration/test_parity_llama_completion.py and test_batching.py)
against the text ``llama-server`` of the pinned tree answers to the same prompt and
settings over ``/v1/completions`` (``presence_penalty``, ``frequency_penalty``,
``repeat_penalty``, ``repeat_last_n``, ``logit_bias``; ``ignore_eos``). Each case must also
differ from the plain greedy text, or it would show nothing. llama-server is built once
(``benches/serve_load.py``'s build, about 13 minutes on 2 cores), so this is a script, not
a test; the suite checks the same sampler chain against ``llama-completion``.
"""

from __future__ import annotations

import http.client
import json
import pathlib
import subprocess
import sys

from harness import cli


PROMPT = ("The history of the printing press begins in the fifteenth century, when Johannes "
          "Gutenberg")


def cases(plain: list[int]) -> list[dict]:
    return [dict(presence_penalty=0.6, frequency_penalty=0.4),
            dict(repeat_penalty=1.4),
            dict(presence_penalty=1.0, frequency_penalty=0.5, repeat_penalty=1.2,
                 penalty_last_n=32, logit_bias=((plain[1], -100.0), (plain[5], -100.0)))]


def main(argv=None) -> int:
    ap = cli.parser(__doc__, json=True)
    ap.add_argument("--tokens", type=int, default=32,
                    help="greedy tokens per case (at least 6: the logit_bias case biases the "
                         "plain run's 2nd and 6th tokens; default 32)")
    a = ap.parse_args(argv)
    if a.tokens < 6:
        ap.error(f"--tokens {a.tokens}: at least 6 (the logit_bias case biases the plain run's "
                 "2nd and 6th tokens)")
    import dgr
    from dgr.core.local import generate_local
    from dgr.protocol.sampling import SamplingParams
    from harness.clusters import free_port
    from harness.llama import llama_server
    from serve_load import _wait_healthy

    from harness.common import smollm2_path

    path = smollm2_path()
    port = free_port()
    proc = subprocess.Popen([llama_server(), "-m", path, "--host", "127.0.0.1", "--port",
                             str(port), "-t", "1", "-c", "512", "-np", "1", "-b", "64", "-ub",
                             "64", "-fa", "on", "-ngl", "0", "--no-webui"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows, ok = [], True
    try:
        _wait_healthy(port, proc, "llama-server")
        e = dgr.Engine(path, n_ctx=512, n_threads=1, n_ubatch=64, flash_attn=True)
        pieces = e.token_pieces()
        ids = [int(t) for t in e.tokenize(PROMPT, True, True)]
        plain, _ = generate_local(e, ids, max_tokens=a.tokens, stop_on_eog=False)
        for kw in cases(plain):
            sp = SamplingParams(**{"penalty_last_n": 64, **kw})
            toks, _ = generate_local(e, ids, max_tokens=a.tokens, sampling=sp,
                                     stop_on_eog=False)
            want = b"".join(pieces[t] for t in toks).decode("utf-8", "replace")
            body = {"prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0,
                    "ignore_eos": True, "presence_penalty": sp.presence_penalty,
                    "frequency_penalty": sp.frequency_penalty,
                    "repeat_penalty": sp.repeat_penalty, "repeat_last_n": sp.penalty_last_n,
                    "logit_bias": {str(t): b for t, b in sp.logit_bias}}
            c = http.client.HTTPConnection("127.0.0.1", port, timeout=300)
            c.request("POST", "/v1/completions", json.dumps(body),
                      {"Content-Type": "application/json"})
            got = json.loads(c.getresponse().read())["choices"][0]["text"]
            c.close()
            same, moved = got == want, toks != plain
            ok &= same and moved
            rows.append({"case": {k: v for k, v in body.items() if k not in ("prompt",)},
                         "same_as_llama_server": same, "differs_from_plain": moved,
                         "dgr": want, "llama_server": got})
            print(f"{'SAME' if same else 'DIFFERENT'} (differs from plain: {moved}): {kw}")
    finally:
        proc.terminate()
        proc.wait()
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps({"prompt": PROMPT, "rows": rows}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
