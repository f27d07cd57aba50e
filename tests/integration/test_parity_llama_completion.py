"""dgr.Engine against llama.cpp itself: greedy output equals upstream llama-completion's."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

import dgr

PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from "
    "wine making. Within fifty years printing shops had opened in more than two hundred "
    "European cities, and the price of books fell sharply. Historians often argue that the "
    "most important consequence of this invention was"
)
N_PREDICT = 40
SETTINGS = dict(n_ctx=512, n_threads=1, n_ubatch=64, flash_attn=True, type_k="f16", type_v="f16")


def _dgr_greedy(model, prompt, n):
    eng = dgr.Engine(model, **SETTINGS)
    toks = eng.tokenize(prompt)
    assert len(toks) > SETTINGS["n_ubatch"], "prompt must span several ubatches"
    logits = eng.forward(0, 0, toks)
    out, pos = [], len(toks)
    for _ in range(n):
        t = int(np.argmax(logits[0]))
        if eng.is_eog(t):
            break
        out.append(t)
        logits = eng.forward(0, pos, [t])
        pos += 1
    return out, eng.detokenize(out)


@pytest.mark.slow
def test_greedy_generation_matches_llama_completion(smollm2, llama_tool):
    exe = llama_tool("llama-completion")
    tokens, text = _dgr_greedy(smollm2, PROMPT, N_PREDICT)
    assert len(tokens) >= 32, "the reference comparison needs at least 32 generated tokens"
    proc = subprocess.run(
        [str(exe), "-m", str(smollm2), "-p", PROMPT, "-n", str(len(tokens)), "--temp", "0",
         "-no-cnv", "--no-display-prompt", "-t", "1", "-tb", "1", "-c", str(SETTINGS["n_ctx"]),
         "-b", str(SETTINGS["n_ubatch"]), "-ub", str(SETTINGS["n_ubatch"]), "-fa", "on",
         "-ctk", "f16", "-ctv", "f16", "--seed", "1", "--simple-io",
         "-ngl", "0"],  # the CPU, as dgr.Engine's default (a build with a GPU backend offloads)
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reference = proc.stdout
    assert reference.startswith(text), (
        f"dgr generated {text!r}\nllama-completion generated {reference!r}")
    # the reference printed exactly our tokens (nothing but trailing whitespace after them)
    assert reference[len(text):].strip() == ""


@pytest.mark.slow
def test_penalties_and_logit_bias_match_llama_completion(smollm2, llama_tool):
    """A split route (two stages) with llama.cpp's penalties and a logit bias, greedy,
    makes the tokens llama.cpp's own sampler chain makes (llama-completion, as llama-server
    feeds it the prompt), and not the unpenalized ones."""
    from dgr.driver.route import Route
    from dgr.protocol.sampling import SamplingParams
    from dgr.worker.process import ThreadedWorker

    exe = llama_tool("llama-completion")
    plain, _ = _dgr_greedy(smollm2, PROMPT, N_PREDICT)
    banned = plain[2]
    sp = SamplingParams(repeat_penalty=1.5, presence_penalty=0.4, frequency_penalty=0.3,
                        penalty_last_n=64, logit_bias=((banned, -100.0),))
    ws = [ThreadedWorker(dgr.Engine(smollm2, layers=r, **SETTINGS), evict_after=3600.0)
          for r in ((0, 15), (15, 30))]
    try:
        with Route([w.address for w in ws], relay=True) as r:
            g = r.complete(PROMPT, max_tokens=N_PREDICT, sampling=sp)
    finally:
        for w in ws:
            w.stop()
    assert len(g.tokens) >= 16 and g.tokens != plain and banned not in g.tokens
    proc = subprocess.run(
        [str(exe), "-m", str(smollm2), "-p", PROMPT, "-n", str(len(g.tokens)), "--temp", "0",
         "--repeat-penalty", "1.5", "--presence-penalty", "0.4", "--frequency-penalty", "0.3",
         "--repeat-last-n", "64", "--logit-bias", f"{banned}-100",
         "-no-cnv", "--no-display-prompt", "-t", "1", "-tb", "1", "-c", str(SETTINGS["n_ctx"]),
         "-b", str(SETTINGS["n_ubatch"]), "-ub", str(SETTINGS["n_ubatch"]), "-fa", "on",
         "-ctk", "f16", "-ctv", "f16", "--seed", "1", "--simple-io", "-ngl", "0"],
        capture_output=True, text=True, timeout=300, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith(g.text) and proc.stdout[len(g.text):].strip() == "", (
        f"dgr generated {g.text!r}\nllama-completion generated {proc.stdout!r}")
