"""Why an architecture is refused a layer range: the reason ``UnsupportedArchitecture`` gives.

Which architectures split is decided in one place, the patched llama.cpp
(``llm_arch_supports_layer_range``, read through ``dgr._core.arch_supports_layer_range``; every
entry proven by the support table of docs/architectures.md). This module decides nothing: it
explains the refusals, grouped by what stands in the way, so that an error names the
architecture and the reason (patches/README.md, 0011, "Left refused").
"""

from __future__ import annotations

__all__ = ["refusal_reason"]

#: recurrent archs whose graphs are not cut yet (RWKV-7's ``v_first`` would cross every seam);
#: the per-layer memory filters of 0003 and 0014 cover every other memory type
MEMORY = frozenset({"rwkv6", "rwkv6qwen2", "rwkv7", "arwkv7"})

#: sparse attention whose shared-indexer layers reuse the top-k of the last full-indexer layer
SHARED_INDEXER = frozenset({"glm-dsa", "glm5-next", "hy_v4"})

#: non-causal or diffusion models (no causal KV cache to keep per stage)
NON_CAUSAL = frozenset({"dream", "llada", "llada-moe", "rnd1"})

#: graphs that carry more than the residual across a seam, or read a global mid-trunk
SPECIFIC = {
    "talkie": "every layer adds the normed token embeddings again (a skip connection), which "
              "would have to cross every seam",
    "cogvlm": "its layers pick text or image weights by whether the batch carries token ids, "
              "which a later stage does not receive",
    "kimi-k3": "its attention residuals mix the outputs of every earlier block (a running sum "
               "over the layers), which would have to cross a seam",
    "hrm_text": "its layers run in nested cycles (the H and L modules reused in turn), not once "
                "each in order",
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
        return ("its recurrent state's graph has not been cut into stages yet (RWKV-7 carries "
                "v_first from its first layer through every other)")
    if arch in SHARED_INDEXER:
        return ("its shared-indexer layers reuse the top-k of the last full-indexer layer, "
                "which would have to cross a seam")
    if arch in NON_CAUSAL:
        return "it is a non-causal, diffusion model: there is no causal cache to keep per stage"
    if arch in SPECIFIC:
        return SPECIFIC[arch]
    return ("its graph has not been cut into stages yet: no stage input, layer loop bounds "
            "or early return")
