"""The sidebands over real worker processes (patches 0018-0024, docs/wire.md "Sidebands"):
``python -m dgr run --parity`` through three workers on talkie (every stage takes the token ids
with the boundary), Kimi-K3 at 26 layers (its seams carry banked residual checkpoints in a row
four times ``n_embd`` wide), cogvlm, qwen4exp (token ids and hyper-connection streams) and
HRM-Text (the cycle state): the whole model's tokens and logits, bit for bit; and a lossy codec
refused on a route whose boundary carries cache cell indices."""

from __future__ import annotations

import pytest

from dgr._core import HAS_LAYER_RANGES
from dgr.testing import archs
from test_hybrid_workers import assert_cli_run_shows_parity  # noqa: E402  (its helper)

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(not HAS_LAYER_RANGES, reason="needs the layer-range patches")]


@pytest.mark.parametrize("arch,n_layer", [("talkie", 0), ("kimi-k3", 26), ("cogvlm", 0),
                                          ("qwen4exp", 0), ("hrm_text", 0)])
def test_cli_run_through_three_workers_shows_parity(arch, n_layer):
    (path,) = archs.write(f"^{arch}$", **({"n_layer": n_layer} if n_layer else {})).files
    assert_cli_run_shows_parity(path)


def test_a_lossy_codec_is_refused_on_a_route_whose_boundary_carries_cell_indices():
    """glm-dsa's boundary may carry the top-k of its last full-indexer layer as cache cell
    indices: a route asked for a lossy codec on it is refused by name; the raw codec runs."""
    import dgr
    from dgr import errors
    from dgr.driver.sync import Route
    from dgr.worker.process import ThreadedWorker

    (path,) = archs.write("^glm-dsa$").files
    settings = dict(n_ctx=64, n_threads=1, n_ubatch=8)
    ws = [ThreadedWorker(dgr.Engine(path, layers=r, **settings)) for r in ((0, 2), (2, 4))]
    try:
        addrs = [w.address for w in ws]
        with pytest.raises(errors.RouteError, match="codec='f16'.*cell indices.*codec='raw'"):
            Route(addrs, codec="f16")
        r = Route(addrs)
        try:
            got = r.session().complete([1, 2, 3], max_tokens=2, stop_on_eog=False)
            assert len(got.tokens) == 2
        finally:
            r.close()
    finally:
        for w in ws:
            w.stop()
