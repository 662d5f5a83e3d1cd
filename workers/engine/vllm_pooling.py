"""The embedding engine: a vLLM pooling model (``runner="pooling"``) driven one step at a time.

The same shape as ``workers.engine.vllm_engine`` (the plumbing both share is
``workers.engine.vllm_shared``): requests go in through ``LLMEngine.add_request`` with
``PoolingParams(task="embed")`` and come out of ``step``, so the runner's leases, write-backs,
deadlines, yields and accounting are the same for embeddings as for text. One runner request
is one embeddings line, which holds up to 2,048 inputs: each input is its own vLLM request
(``<request id>#<input index>``), and the line finishes when its last input does.

Memory stays bounded whatever the line sizes: at most ``max_in_flight`` inputs are inside vLLM
at once; the rest of a line's inputs wait here as token ids (which the runner holds anyway) and
join as others finish. A finished input keeps only its vector (``dim × 4`` bytes) until its line
is complete, and the runner writes finished lines back every ``flush_seconds``.

Vectors are what the model's pooler returns: for a sentence-transformers folder vLLM reads
``modules.json`` (all-MiniLM-L6-v2: mean pooling, then L2 normalization), so they match
``SentenceTransformer.encode`` (``tests/integration/test_embeddings.py``).
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from offpeak.settings import ModelConfig
from workers.engine.base import (
    EngineCapabilities,
    EngineRequest,
    EngineResult,
    RequestRefused,
    UsageMeter,
)
from workers.engine.vllm_shared import (
    engine_core_dead,
    engine_core_environment,
    engine_kwargs,
    process_environment,
    request_errors,
    tokens_prompt,
    watch_engine_core,
)

if TYPE_CHECKING:
    from vllm import LLM
    from vllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

#: Inputs inside vLLM at once, per ``max_num_seqs``: enough to fill every step's batch while
#: the next inputs are queued, few enough that vLLM holds no line's worth of 2,048 requests.
IN_FLIGHT_PER_SEQ = 2

#: Environment of this engine's processes while they start (a value the operator set wins): off,
#: oneDNN's global primitive cache stops growing the model runner by a primitive per step's token
#: count (``offpeak bench embeddings``, ``docs/benchmarks.md``).
ENGINE_PROCESS_ENV = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}


@dataclass
class _Line:
    """One runner request: its inputs, and the vectors of those that finished."""

    inputs: tuple[tuple[int, ...], ...]
    dimensions: int | None
    priority: int
    vectors: list[bytes | None]
    #: Inputs not yet given to vLLM, by index.
    waiting: deque[int]
    #: This line's inputs inside vLLM: our id (``<line>#<index>``, which outputs carry) -> vLLM's
    #: internal id (ours plus a random suffix, which ``abort_request(internal=True)`` takes).
    inside: dict[str, str] = field(default_factory=dict)
    done: int = 0


class VllmPoolingEngine:
    """One embedding model loaded in vLLM's pooling runner, driven by ``add`` / ``step`` /
    ``abort``. Serves pooling lines only (``EngineRequest.pooling``: ``/v1/embeddings``, and
    ``/v1/score`` / ``/v1/rerank``, whose texts it embeds); a text line sent to it fails alone.
    Not thread-safe: one runner drives it."""

    def __init__(self, llm: LLM, model_name: str) -> None:
        self._llm: LLM | None = llm
        self._llm_engine: LLMEngine | None = llm.llm_engine
        self._tokenizer = llm.get_tokenizer()
        self.model_name = model_name
        config = llm.llm_engine.vllm_config
        self.max_model_len: int = config.model_config.max_model_len
        self.vocab_size: int = len(self._tokenizer)
        max_num_seqs = int(config.scheduler_config.max_num_seqs)
        self.max_in_flight = IN_FLIGHT_PER_SEQ * max_num_seqs
        # An encoder-only model has no KV cache worth sizing by: its room is ``max_num_seqs``.
        self.capabilities = EngineCapabilities(pooling=True, max_num_seqs=max_num_seqs)
        self.server_meter: UsageMeter | None = None
        #: The vector size (``offpeak.endpoints.embeddings`` refuses lines for a model without).
        self.embedding_size: int = int(config.model_config.get_hidden_size())
        #: ``None``: ``dimensions`` is refused (all-MiniLM-L6-v2 was not trained for it).
        self.matryoshka_dimensions: tuple[int, ...] | None = None
        if config.model_config.is_matryoshka:
            self.matryoshka_dimensions = tuple(config.model_config.matryoshka_dimensions or ())
        self._lines: dict[str, _Line] = {}
        #: Lines with inputs not yet in vLLM, in the order they were added.
        self._feeding: deque[str] = deque()
        #: Our id of each input inside vLLM (``<line>#<index>``) -> (line id, input index).
        self._inside: dict[str, tuple[str, int]] = {}
        self._closed = threading.Event()
        threading.Thread(
            target=watch_engine_core,
            args=(llm.llm_engine, self._closed),
            daemon=True,
            name=f"engine-core-watch-{model_name}",
        ).start()

    @classmethod
    def load(cls, name: str, config: ModelConfig, model_path: Path) -> VllmPoolingEngine:
        """Start vLLM's pooling runner on the Hugging Face folder ``model_path``.
        ``config.engine_args`` override everything, as for text models. Raises whatever vLLM
        raises for a model or setting it cannot load."""
        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = engine_kwargs(name, config, model_path, on_cpu=current_platform.is_cpu())
        kwargs.setdefault("runner", "pooling")
        # Encoder-only attention: no prefix to cache, and no partial prefill.
        kwargs["enable_prefix_caching"] = False
        kwargs["enable_chunked_prefill"] = False
        if config.block_size is None and "block_size" not in config.engine_args:
            # The text engine's CPU block size was chosen for prefix caching, which this one has
            # none of: keep vLLM's own.
            kwargs.pop("block_size", None)
        started = time.monotonic()
        logger.info("loading embedding model %s from %s into vLLM", name, model_path)
        with process_environment({**ENGINE_PROCESS_ENV, **engine_core_environment(kwargs)}):
            llm = LLM(**kwargs)
        logger.info("embedding model %s loaded in %.1f s", name, time.monotonic() - started)
        return cls(llm, name)

    # Tokenization ---------------------------------------------------------------------------

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """An embedding model has no chat template: ``ValueError``, and the line fails alone."""
        raise ValueError(f"{self.model_name} is an embedding model; it serves /v1/embeddings only")

    def encode_text(self, text: str) -> list[int]:
        """Token ids of one input with the tokenizer's specials (BERT: ``[CLS]`` … ``[SEP]``)."""
        return list(self._tokenizer.encode(text))

    @property
    def _engine(self) -> LLMEngine:
        if self._llm_engine is None:
            raise RuntimeError(f"engine for {self.model_name} is closed")
        return self._llm_engine

    # Requests --------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue an embeddings line; its inputs join vLLM as room frees up. Raises
        ``RequestRefused`` for a text request, an id already in flight or an input vLLM's own
        validation refuses (a token id outside the vocabulary)."""
        if request.pooling is None:
            raise RequestRefused(
                f"The model {self.model_name!r} is an embedding model; it serves "
                "/v1/embeddings only.",
                "model",
                "invalid_value",
            )
        if request.request_id in self._lines:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        vocab = self.vocab_size
        for i, ids in enumerate(request.pooling.inputs):
            if max(ids) >= vocab:
                raise RequestRefused(
                    f"Invalid 'input[{i}]': token id {max(ids)} is outside the model's "
                    f"vocabulary of {vocab} tokens.",
                    f"input[{i}]",
                    "invalid_value",
                )
        count = len(request.pooling.inputs)
        self._lines[request.request_id] = _Line(
            inputs=request.pooling.inputs,
            dimensions=request.pooling.dimensions,
            priority=request.priority,
            vectors=[None] * count,
            waiting=deque(range(count)),
        )
        self._feeding.append(request.request_id)
        self._feed()

    def _feed(self) -> None:
        """Move waiting inputs into vLLM, oldest line first, up to ``max_in_flight``."""
        from vllm import PoolingParams

        while self._feeding and len(self._inside) < self.max_in_flight:
            line_id = self._feeding[0]
            line = self._lines[line_id]
            if not line.waiting:
                self._feeding.popleft()
                continue
            index = line.waiting.popleft()
            input_id = f"{line_id}#{index}"
            try:
                internal = self._engine.add_request(
                    input_id,
                    tokens_prompt(list(line.inputs[index])),
                    PoolingParams(task="embed", dimensions=line.dimensions),
                    priority=line.priority,
                )
            except request_errors() as exc:
                # Checked in ``add`` already; anything vLLM still refuses is the line's own.
                raise RequestRefused(str(exc), f"input[{index}]") from exc
            # Outputs carry our id; releases before request-id randomization return None.
            self._inside[input_id] = (line_id, index)
            line.inside[input_id] = internal if isinstance(internal, str) else input_id

    def step(self) -> list[EngineResult]:
        """Run one engine step; return the lines whose last input finished in it."""
        if engine_core_dead(self._engine):
            raise RuntimeError(f"the engine core of {self.model_name} is dead")
        self._feed()
        if not self._inside:
            return []
        if not self._engine.has_unfinished_requests():
            # Inputs we hold as inside that vLLM no longer has would never finish: a fault
            # (the runner hands the lines back) rather than a loop stepping nothing forever.
            raise RuntimeError(f"{len(self._inside)} inputs are missing from the engine")
        from vllm.outputs import PoolingRequestOutput

        results = []
        for output in self._engine.step():
            if not isinstance(output, PoolingRequestOutput) or not output.finished:
                continue
            where = self._inside.pop(output.request_id, None)
            if where is None:  # raced an abort
                continue
            line_id, index = where
            line = self._lines[line_id]
            line.inside.pop(output.request_id, None)
            line.vectors[index] = _vector_bytes(output.outputs.data)
            line.done += 1
            if line.done == len(line.inputs):
                del self._lines[line_id]
                results.append(self._result(line_id, line))
        self._feed()
        return results

    def _result(self, line_id: str, line: _Line) -> EngineResult:
        vectors = [v for v in line.vectors if v is not None]
        return EngineResult(
            request_id=line_id,
            prompt_tokens=sum(len(ids) for ids in line.inputs),
            cached_tokens=0,
            completions=[],
            embeddings=vectors,
        )

    def abort(self, request_ids: list[str]) -> None:
        """Drop lines, queued or running; they return no result. Unknown ids are ignored."""
        internal: list[str] = []
        for request_id in request_ids:
            line = self._lines.pop(request_id, None)
            if line is None:
                continue
            for input_id in line.inside:
                self._inside.pop(input_id, None)
            internal.extend(line.inside.values())
        if request_ids:
            self._feeding = deque(rid for rid in self._feeding if rid in self._lines)
        if not internal:
            return
        try:
            self._engine.abort_request(internal, internal=True)
        except TypeError:  # older releases: no ``internal`` flag
            self._engine.abort_request(internal)

    def num_unfinished(self) -> int:
        """Lines added and neither finished nor aborted."""
        return len(self._lines)

    def close(self) -> None:
        """Stop the engine-core process and free the model. Safe to call twice."""
        engine, self._llm_engine, self._llm = self._llm_engine, None, None
        if engine is None:
            return
        self._closed.set()
        logger.info("shutting down embedding model %s", self.model_name)
        self._lines.clear()
        self._inside.clear()
        self._feeding.clear()
        engine.engine_core.shutdown()
        del engine
        gc.collect()


def _vector_bytes(data: Any) -> bytes:
    """A pooled vector (a 1-D torch tensor) as little-endian float32 bytes."""
    import numpy as np

    return np.asarray(data.detach().to("cpu").float().numpy(), dtype="<f4").tobytes()
