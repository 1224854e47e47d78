"""The HTTP server: OpenAI-compatible routes over an AsyncLLMEngine, metrics, and a demo web page.

Needs the ``server`` extra (FastAPI, uvicorn, pydantic, prometheus-client). Start it with
``minfer serve`` or build the app yourself with ``minfer.server.app.build_app(engine)``.
"""
