"""Tooling that runs SGLang as a separate process (server runner, offline model factory, the demo).

Nothing here imports sglang or torch in-process beyond what its own functions need lazily."""
