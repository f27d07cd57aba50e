"""The status page's figures (dgr.serve.status) with a fake clock and fake stages, and its
static files (relative URLs only: no CDN, works behind a path prefix)."""

from __future__ import annotations

import asyncio
import html.parser
import re
from types import SimpleNamespace

import pytest

from dgr.serve import status
from dgr.serve.app import STATIC


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_traffic_counts_the_window_only():
    c = Clock()
    t = status.Traffic(window_s=10, clock=c)
    c.t += 10  # served for a whole window already
    t.first_token(0.5)
    t.token(None)
    for _ in range(9):
        c.t += 0.1
        t.token(0.1)
    s = t.snapshot()
    assert s["tokens_per_s"] == pytest.approx(10 / 10)  # 10 tokens over the 10 s window...
    assert s["ttft_ms"] == pytest.approx(500) and s["tpot_ms"] == pytest.approx(100)
    c.t += 20  # ...all older than the window now
    s = t.snapshot()
    assert s == {"window_s": 10, "tokens_per_s": 0.0, "ttft_ms": None, "tpot_ms": None,
                 "drafted": 0, "accepted": 0, "acceptance": None, "tokens_per_trip": None}


def test_traffic_before_a_full_window_divides_by_the_time_served():
    c = Clock()
    t = status.Traffic(window_s=10, clock=c)
    c.t += 2
    for _ in range(4):
        t.token(None)
    assert t.snapshot()["tokens_per_s"] == pytest.approx(2.0)


def test_seam_is_the_time_per_token_less_compute_per_link():
    stages = [{"compute_ms": 2.0}, {"compute_ms": 3.0}, {"compute_ms": 1.0}]
    assert status.seam_ms(9.0, stages, 3) == pytest.approx(1.0)
    assert status.seam_ms(None, stages, 3) is None
    assert status.seam_ms(9.0, stages + [{"compute_ms": None}], 4) is None
    assert status.seam_ms(5.0, stages, 3) is None  # compute above the time: no figure
    assert status.links_of("relay", 3) == 4 and status.links_of("relay+loop", 3) == 3
    assert status.links_of("hop-by-hop", 3) == 3


def _info(steps, compute_s, **kw):
    d = dict(draining=False, free_slots=2, sessions=0, queue_depth=0, free_context=256,
             recent_tokens_per_s=0.0, steps_total=steps, errors_total=0, recent_step_ms=0.0,
             decode_steps_total=steps, decode_compute_s_total=compute_s)
    d.update(kw)
    return SimpleNamespace(**d)


class FakeClient:
    def __init__(self, endpoint, infos):
        self.endpoint, self.infos = endpoint, list(infos)

    async def describe(self):
        x = self.infos.pop(0)
        if isinstance(x, BaseException):
            raise x
        return x


def test_stage_watch_computes_between_polls_and_survives_a_stage_down():
    from dgr import errors

    a = FakeClient("a:1", [_info(10, 0.10), _info(20, 0.15), _info(20, 0.15)])
    b = FakeClient("b:1", [_info(5, 0.05), errors.WorkerUnavailable("gone"),
                           _info(7, 0.07, draining=True, free_slots=1)])
    static = [SimpleNamespace(endpoint=e, layers=(i * 15, i * 15 + 15),
                              settings={"n_slots": 2}, n_ctx=128)
              for i, e in enumerate(["a:1", "b:1"])]
    c = Clock()
    w = status.StageWatch(SimpleNamespace(clients=[b, a], stages=static), clock=c)
    first = asyncio.run(w.stages())
    assert [s["compute_ms"] for s in first] == [None, None]  # one describe: no delta yet
    c.t += 1
    second = asyncio.run(w.stages())
    assert second[0]["compute_ms"] == pytest.approx(5.0)  # 0.05 s over 10 steps
    assert second[1]["health"] == "down" and "WorkerUnavailable" in second[1]["error"]
    c.t += 3
    third = asyncio.run(w.stages())
    # no new steps on a: its last figure, with its age
    assert third[0]["compute_ms"] == pytest.approx(5.0)
    assert third[0]["compute_age_s"] == pytest.approx(3.0)
    assert third[1]["health"] == "draining" and third[1]["slots_used"] == 1
    assert third[1]["compute_ms"] == pytest.approx(10.0)  # 0.02 s over 2 steps, from poll 1
    assert [s["layers"] for s in third] == [[0, 15], [15, 30]]


class _Links(html.parser.HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def test_the_page_loads_nothing_from_elsewhere():
    p = _Links()
    p.feed((STATIC / "index.html").read_text())
    assert "static/status.js" in p.urls and "static/status.css" in p.urls
    for u in p.urls:
        assert not re.match(r"^([a-z]+:)?//", u) and not u.startswith("/"), u
        if u.startswith("static/"):
            assert (STATIC / u.removeprefix("static/")).is_file()
    for name in ("status.js", "status.css"):
        text = (STATIC / name).read_text()
        assert not re.search(r"https?://|@import|url\(", text), name


def test_history_keeps_one_sample_per_interval_over_its_span():
    from dgr.serve.status import History

    now = [0.0]
    h = History(span_s=10.0, every_s=2.0, clock=lambda: now[0])
    for t in range(0, 30):  # a poll every second
        now[0] = float(t)
        h.add({"tokens_per_s": float(t), "waiting": t % 3, "ttft_ms": None}, [1.0, float(t)])
    s = h.series()
    # one sample per 2 s, the last 10 s of them: polls at 20, 22, ..., 28
    assert s["tokens_per_s"] == [20.0, 22.0, 24.0, 26.0, 28.0]
    assert s["age_s"] == [9.0, 7.0, 5.0, 3.0, 1.0] and s["span_s"] == 10.0
    assert s["compute_ms"][-1] == [1.0, 28.0] and s["waiting"][-1] == 28 % 3
    assert s["ttft_ms"] == [None] * 5 and s["seam_ms"] == [None] * 5


def test_traffic_counts_the_speculation_of_the_generations_that_ended_in_the_window():
    now = [0.0]
    t = status.Traffic(window_s=10.0, clock=lambda: now[0])
    s = t.snapshot()
    assert s["drafted"] == 0 and s["acceptance"] is None and s["tokens_per_trip"] is None
    t.speculation(trips=10, drafted=8, accepted=6)
    now[0] = 5.0
    t.speculation(trips=4, drafted=0, accepted=0)  # a generation without drafts
    s = t.snapshot()
    assert (s["drafted"], s["accepted"]) == (8, 6) and s["acceptance"] == 0.75
    assert s["tokens_per_trip"] == (14 + 6) / 14
    now[0] = 12.0  # the first generation left the window
    s = t.snapshot()
    assert s["drafted"] == 0 and s["acceptance"] is None
