"""The README's first SDK example runs as written (imports, the split forward, bit identity)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dgr._core import HAS_LAYER_RANGES

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


@pytest.mark.slow
@pytest.mark.skipif(not HAS_LAYER_RANGES, reason="the example splits the model")
def test_the_readme_sdk_example_runs(smollm2):
    blocks = re.findall(r"^```python\n(.*?)^```", README, re.S | re.M)
    assert blocks, "README has no python example"
    code = blocks[0]
    assert "models.path()" in code and "assert logits.tobytes()" in code, code
    ns: dict = {}
    exec(compile(code, "README.md", "exec"), ns)  # noqa: S102 - the project's own README
    assert ns["logits"].shape == (1, ns["whole"].n_vocab)
