"""`k3 serve`: an OpenAI-compatible HTTP server with streaming, continuous batching and strict input checking.

    from k3.serve import ServeConfig, create_app, run_server
    app = create_app(model, tokenizer, ServeConfig(model_name="k3-tiny", max_batch=8))
    run_server(app, host="127.0.0.1", port=8000)     # uvicorn + the serving limits; 1 if the scheduler died

The HTTP parts (app.py: fastapi, uvicorn, main dependencies of k3) are imported lazily; the scheduler needs neither.
"""
from k3.serve.scheduler import GenRequest, QueueFull, Scheduler

__all__ = ["GenRequest", "QueueFull", "Scheduler", "ServeConfig", "create_app", "make_server", "run_server"]


def __getattr__(name):  # the FastAPI app is imported lazily (the scheduler alone needs no fastapi)
    if name in ("ServeConfig", "create_app", "make_server", "run_server"):
        from k3.serve import app
        return getattr(app, name)
    raise AttributeError(name)
