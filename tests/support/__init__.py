"""Helpers shared by the test folders (``tests/`` is on ``sys.path``: ``from support import ...``).

* ``support.net``: ``free_port()``.
* ``support.stub_upstream``: ``StubServer``, the one stub OpenAI-compatible upstream.
* ``support.steer``: ``steer_opening``, scripted opening tokens for constrained requests.
"""
