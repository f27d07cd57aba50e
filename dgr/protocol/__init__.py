"""What crosses between stages and drivers, one definition each (pure Python, no compiled core).

- ``dgr.protocol.wire``: the frame format (headers, boundary payloads, codecs).
- ``dgr.protocol.settings``: the numeric engine settings and the stage identity frames carry.
- ``dgr.protocol.describe``: a stage's describe record (``StageInfo``) and compute figures.
- ``dgr.protocol.capability``: the capability record's schema (what a tracker reads).
- ``dgr.protocol.sampling``: sampling parameters and the sampler the last stage runs.
- ``dgr.protocol.ranges``: how a model's layers split into contiguous stage ranges.
"""
