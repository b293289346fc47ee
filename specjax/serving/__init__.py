"""specjax-serve as a library: an OpenAI-compatible HTTP server over the refilling engine.

`app` holds the engine thread and the routes (`build_app`), `protocol` the OpenAI API without HTTP (request checks,
response and chunk bodies, errors), `metrics` the Prometheus metrics, `hosts` serving across the processes of a
multi-host run.
"""

from specjax.serving.app import build_app, running_in_thread

__all__ = ["build_app", "running_in_thread"]
