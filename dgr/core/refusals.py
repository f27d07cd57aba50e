"""Why an architecture is refused a layer range: the reason ``UnsupportedArchitecture`` gives.

Which architectures split is decided in one place, the patched llama.cpp
(``llm_arch_supports_layer_range``, read through ``dgr._core.arch_supports_layer_range``; every
entry proven by the support table of docs/architectures.md). This module decides nothing: it
explains the refusals, grouped by what stands in the way, so that an error names the
architecture and the reason (patches/README.md, 0011, "Left refused").
"""

from __future__ import annotations

__all__ = ["refusal_reason"]

#: recurrent archs whose graphs are not cut yet: RWKV6-Qwen2 (QRWKV6), which upstream's generator
#: cannot write a fixture of, so no split of it is proven (rwkv6, rwkv7 and arwkv7 split, 0025)
MEMORY = frozenset({"rwkv6qwen2"})

#: non-causal or diffusion models (no causal KV cache to keep per stage)
NON_CAUSAL = frozenset({"dream", "llada", "llada-moe", "rnd1"})

#: graphs that carry more than the residual across a seam, or run their layers out of order
SPECIFIC = {
    "gemma3n": "its per-layer inputs (computed from the token embeddings) would have to cross "
               "every seam",
    "gemma4": "its per-layer inputs (computed from the token embeddings) would have to cross "
              "every seam",
}


def refusal_reason(arch: str) -> str:
    """Why ``arch`` is refused a partial layer range, in one phrase."""
    if arch in MEMORY:
        return ("its recurrent graph has not been cut into stages yet: no fixture of it can be "
                "written to prove a split (the generator's RWKV6-Qwen2 crashes)")
    if arch in NON_CAUSAL:
        return "it is a non-causal, diffusion model: there is no causal cache to keep per stage"
    if arch in SPECIFIC:
        return SPECIFIC[arch]
    return ("its graph has not been cut into stages yet: no stage input, layer loop bounds "
            "or early return")
