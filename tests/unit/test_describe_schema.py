"""One describe record, three spellings: the proto's ``DescribeReply``, ``StageInfo`` (what a
client reads) and ``Worker.describe`` (what a worker fills). A field added to one of them and
not the others fails here. No model: a stand-in engine with the facts a worker reads
(``stand_in``, tests/unit/conftest.py)."""

from __future__ import annotations

import dataclasses

import pytest

from dgr._proto import dgr_pb2
from dgr.protocol.describe import COUNTERS, StageInfo
from dgr.protocol.settings import NUMERIC_SETTINGS
from dgr.worker.worker import Worker

PROTO = set(dgr_pb2.DescribeReply.DESCRIPTOR.fields_by_name)
#: StageInfo's own: the endpoint it was read from, ``layers`` for the proto's
#: ``layer_start``/``layer_end``, and ``extra``
STAGE_INFO_ONLY = {"endpoint", "layers", "extra"}
#: the proto's fields StageInfo holds otherwise: the range as ``layers``; the capability record
#: is read by ``ShardClient.capability()``
PROTO_ONLY = {"layer_start", "layer_end", "capability_json"}


@pytest.fixture()
def worker(stand_in):
    w = Worker(stand_in)
    yield w
    w.pipeline.scheduler.stop()


def test_worker_describe_fills_exactly_the_proto_fields(worker):
    d = worker.describe()
    assert set(d) == PROTO, (sorted(set(d) - PROTO), sorted(PROTO - set(d)))
    assert tuple(d["settings"]) == NUMERIC_SETTINGS
    assert set(NUMERIC_SETTINGS) == set(dgr_pb2.EngineSettings.DESCRIPTOR.fields_by_name)
    assert set(COUNTERS) <= PROTO


def test_stage_info_holds_the_proto_fields():
    fields = {f.name for f in dataclasses.fields(StageInfo)}
    assert STAGE_INFO_ONLY <= fields
    assert fields - STAGE_INFO_ONLY == PROTO - PROTO_ONLY, (
        sorted(fields - STAGE_INFO_ONLY - PROTO), sorted(PROTO - PROTO_ONLY - fields))


def test_a_describe_reaches_stage_info_field_by_field(worker, stand_in):
    # what the server sends (dgr.transport.server) and a client reads (StageInfo.from_proto)
    d = worker.describe()
    reply = dgr_pb2.DescribeReply(**{**d, "settings": dgr_pb2.EngineSettings(**d["settings"])})
    info = StageInfo.from_proto("127.0.0.1:1", reply)
    got = info.to_dict()
    for name in PROTO - PROTO_ONLY:
        want = d[name]
        if name == "eog_tokens":
            want = sorted(want)
        if isinstance(want, float):
            assert got[name] == pytest.approx(want), name
        else:
            assert got[name] == want, name
    assert info.layers == stand_in.layers and info.settings == stand_in.settings
    assert info.eog_tokens == {4, 9} and info.needs_token_ids and info.add_bos
