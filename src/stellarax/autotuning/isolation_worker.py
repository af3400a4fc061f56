"""Entry point of a measuring worker process: `python -m stellarax.autotuning.isolation_worker`.

See `isolation.py`; this module only starts its request loop (a module of its own, so
that running it does not import the loop's module a second time as `__main__`).
"""

from stellarax.autotuning.isolation import serve_requests

if __name__ == "__main__":
  serve_requests()
