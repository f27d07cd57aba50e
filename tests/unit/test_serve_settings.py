"""``ServeSettings``: the front's settings in one table, checked when made, built by
``python -m dgr serve`` from its flags and taken by ``create_app`` (or its fields)."""

from __future__ import annotations

import pytest

from dgr import errors
from dgr.serve.settings import SERVE_FLAGS, ServeSettings


@pytest.mark.parametrize("bad", [dict(pooling="max"), dict(prompt_cache=-1),
                                 dict(prompt_cache_ttl=0), dict(max_per_key=-1),
                                 dict(queue_timeout=-1.0)])
def test_a_bad_setting_is_refused_by_name(bad):
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name.split("_")[0]):
        ServeSettings(**bad)


def test_the_commands_flags_give_the_settings_and_differ_only_where_said():
    from dgr.cli.commands import build_parser

    assert set(SERVE_FLAGS) <= set(ServeSettings.__dataclass_fields__)
    got = ServeSettings.from_args(build_parser().parse_args(["serve"]))
    # the command keeps two ended sessions by default; an embedding app none unless asked
    assert got == ServeSettings(prompt_cache=2)
    got = ServeSettings.from_args(build_parser().parse_args(
        ["serve", "--queue-timeout", "0.5", "--max-requests-per-key", "3", "--prompt-cache",
         "0", "--prompt-cache-ttl", "9", "--no-prefix-store", "--pooling", "mean"]))
    assert got == ServeSettings(queue_timeout=0.5, max_per_key=3, prompt_cache=0,
                                prompt_cache_ttl=9.0, prefix_store=False, pooling="mean")


def test_create_app_takes_the_settings_or_their_fields_and_refuses_others():
    from types import SimpleNamespace

    from dgr.serve.app import create_app

    route = SimpleNamespace(stages=[])
    with pytest.raises(errors.InvalidArgument, match="unknown front setting.*prompt_cash"):
        create_app(route, model="m", prompt_cash=2)
    with pytest.raises(ValueError, match="pooling"):
        create_app(route, model="m", pooling="max")
    app = create_app(route, model="m", settings=ServeSettings(prompt_cache=1, max_per_key=2),
                     prefix_store=False)
    front = app.router.lifespan_context.__self__  # the app's parts
    assert front.settings == ServeSettings(prompt_cache=1, max_per_key=2, prefix_store=False)
    assert (front.pool.size, front.pool.store) == (1, False)
