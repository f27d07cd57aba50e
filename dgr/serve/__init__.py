"""dgr's OpenAI-compatible HTTP front over a route (docs/serve.md).

``python -m dgr serve`` starts it (on a local cluster, or in front of running workers); an
application embeds it as an ASGI app: ``dgr.serve.app.create_app(AsyncRoute(...), model=...)``.
``dgr.serve.templates`` renders a model's chat template (sandboxed Jinja2).
"""
