"""The end-to-end tier: real engines. Modules in a folder here share one engine and run on one
xdist worker, one after another (``live/``: the live stack; ``engines/``: the in-process SmolLM2
engine); every other module here starts engines of its own (``tests/conftest.py``)."""
