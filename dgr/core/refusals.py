"""Why an architecture is refused a layer range: the reason ``UnsupportedArchitecture`` gives.

Which architectures split is decided in one place, the patched llama.cpp
(``llm_arch_supports_layer_range``, read through ``dgr._core.arch_supports_layer_range``; every
entry proven by the support table of docs/architectures.md). This module decides nothing: it
explains the refusals, grouped by what stands in the way, so that an error names the
architecture and the reason (patches/README.md, 0011, "Left refused").
"""

from __future__ import annotations

__all__ = ["refusal_reason"]

#: KV or state memory that 0003's per-layer filter does not cover: recurrent and hybrid
#: (SSM, linear attention) states, and the DSA / lightning-indexer caches
MEMORY = frozenset({
    "mamba", "mamba2", "jamba", "falcon-h1", "granitehybrid", "nemotron_h", "nemotron_h_moe",
    "plamo2", "lfm2", "lfm2moe", "qwen3next", "qwen35", "qwen35moe", "kimi-linear",
    "minimax-01", "minimax-m3", "rnd1", "dots3note", "deepseek32", "glm-dsa", "glm5-next",
    "rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7",
})

#: non-causal or diffusion models (no causal KV cache to keep per stage)
NON_CAUSAL = frozenset({"dream", "llada", "llada-moe"})

#: graphs that carry more than the residual across a seam, or read a global mid-trunk
SPECIFIC = {
    "gpt2": "its absolute position embedding is added at the input, which its stage graph "
            "does not yet keep on the first stage",
    "bloom": "its input layer norm runs on the embeddings, which its stage graph does not yet "
             "keep on the first stage",
    "nanbeige": "its looped layers read the output norm in the middle of the trunk",
    "qwen3vl": "its deepstack features are added to the outputs of early layers, which a "
               "later stage would need at the seam",
    "gemma3n": "its per-layer inputs (computed from the token embeddings) would have to cross "
               "every seam",
    "gemma4": "its per-layer inputs (computed from the token embeddings) would have to cross "
              "every seam",
}


def refusal_reason(arch: str) -> str:
    """Why ``arch`` is refused a partial layer range, in one phrase."""
    if arch in MEMORY:
        return ("its KV/state memory, recurrent, hybrid or an indexer cache, has no per-stage "
                "layer filter yet")
    if arch in NON_CAUSAL:
        return "it is a non-causal, diffusion model: there is no causal cache to keep per stage"
    if arch in SPECIFIC:
        return SPECIFIC[arch]
    return ("its graph has not been cut into stages yet: no stage input, layer loop bounds "
            "or early return")
