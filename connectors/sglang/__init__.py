"""kvstore as SGLang HiCache's L3 storage backend (see ``backend.py`` and the README's SGLang section).

Nothing is imported here: only :mod:`connectors.sglang.backend` needs SGLang,
so the rest of the package (and the project's own test run) loads without it.
"""
