"""``kvstore engine serve``: an OpenAI-compatible HTTP server over the built-in engine.

:mod:`engine.server.prompt` turns a request into the engine's token ids (the
router uses it too), :mod:`engine.server.worker` runs the engine on its own
thread with a request queue and in-flight accounting, and
:mod:`engine.server.app` is the aiohttp application.
"""
