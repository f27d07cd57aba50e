"""dgr.testing.serving.Served: the clients it gives are closed when it stops, so no test
leaves pooled sockets to the garbage collector (their ResourceWarning failed whichever later
test was running when they were collected: seen once in a clean-clone run)."""

import gc
import warnings

from starlette.applications import Starlette
from starlette.responses import JSONResponse
from starlette.routing import Route

from dgr.testing.serving import Served


async def _models(request):
    return JSONResponse({"object": "list", "data": [
        {"id": "m", "object": "model", "created": 0, "owned_by": "dgr"}]})


def test_stop_closes_the_clients_it_gave_and_nothing_is_left_to_the_collector():
    s = Served(Starlette(routes=[Route("/v1/models", _models)]))
    try:
        clients = [s.openai(), s.openai(api_key="other"), s.anthropic()]
        for c in clients[:2]:
            assert [m.id for m in c.models.list().data] == ["m"]  # a pooled connection each
        assert not any(c.is_closed() for c in clients)
    finally:
        s.stop()
    assert all(c.is_closed() for c in clients) and s.clients == []
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        del clients, c
        gc.collect()
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], seen
