"""`apps serve` in a subprocess on a free local port, through real clients: the official `openai`
client (completions, chat, streaming), continuous batching that gives what one request at a time
gives, a disconnect freeing its slots, the key, every bad request with its status, a slow client
cut off, predict batching, and SIGTERM draining what is in flight."""

import base64
import contextlib
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx2 as httpx
import numpy as np
import openai
import pytest
import soundfile
from helpers import apps, plain
from test_multiprocess import free_port

import tasks
from core import run
from core.serving import load as serve_bench
from tasks.common.tokenizer import PretrainedTokenizer
from tasks.nlp.lm import LanguageModel
from tasks.protein.classify import ProteinClassTask

ROOT = Path(__file__).resolve().parents[1]
KEY = "test-key-1234"
PROMPTS = ["the", "a b c", "then there", "x", "thee the", "zz top"]


@contextlib.contextmanager
def serving(tmp: Path, *args: str, key: str | None = KEY) -> Iterator[tuple[subprocess.Popen, str, Path]]:
    """A server of `args` (its models and options), once /health answers: (process, base URL,
    log); killed on the way out if it is still running."""
    port = free_port()
    log = tmp / f"server-{port}.log"
    command = [sys.executable, "-m", "cli", "serve", "--port", str(port), *args, *(["--api-key", key] if key else [])]
    environment = os.environ | {"COLUMNS": "400"}
    with log.open("w") as output:
        process = subprocess.Popen(command, cwd=ROOT, env=environment, stdout=output, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 180
        while True:
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        yield process, url, log
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny):
    tmp = tmp_path_factory.mktemp("serve")
    sentiment = tmp / "sentiment"
    trained = apps(
        "train",
        "sentiment",
        "--preset",
        "tiny",
        "--data",
        "synthetic",
        "--set",
        "train.steps=20",
        "--workdir",
        sentiment,
    )
    assert trained.exit_code == 0, trained.output
    server_options = ("--max-batch", "4", "--max-wait-ms", "300", "--read-timeout", "2")
    with serving(tmp, "--workdir", str(sentiment), "--model", str(tiny), *server_options) as (
        _,
        url,
        log,
    ):
        yield url, log


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0)


def auth() -> dict:
    return {"Authorization": f"Bearer {KEY}"}


def metric(url: str, name: str, **labels) -> float:
    """A sample's value from /metrics (0 when absent)."""
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in httpx.get(f"{url}/metrics", headers=auth()).text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} ") or (not labels and line.startswith(f"{name} ")):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_the_openai_client_completes_chats_and_streams_what_the_model_gives_in_process(server, tiny):
    url, log = server
    local = LanguageModel(model=str(tiny))
    expected = local.generate(["the"], max_new_tokens=8, temperature=0.0)[0]
    answer = client(url).completions.create(model="tiny.gguf", prompt="the", max_tokens=8, temperature=0)
    assert answer.choices[0].text == expected and answer.choices[0].finish_reason == "length"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (2, 8)  # the start id and "the"
    streamed = list(
        client(url).completions.create(
            model="tiny.gguf",
            prompt="the",
            max_tokens=8,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(chunk.choices[0].text for chunk in streamed[:-1]) == expected
    assert streamed[-1].choices == [] and streamed[-1].usage.completion_tokens == 8

    messages = [{"role": "user", "content": "hi there"}]
    said = local.generate([json.dumps(messages)], max_new_tokens=6, temperature=0.0, chat=True)[0]
    chat = client(url).chat.completions.create(model="tiny.gguf", messages=messages, max_tokens=6, temperature=0)
    assert chat.choices[0].message.content == said and chat.choices[0].message.role == "assistant"
    chunks = client(url).chat.completions.create(
        model="tiny.gguf", messages=messages, max_tokens=6, temperature=0, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == said
    assert [m.id for m in client(url).models.list().data] == ["sentiment", "tiny.gguf"]
    started = (
        r"4 slots of 128 positions, float32 weights, holding [\d.]+ MB of weights, [\d.]+ MB of cache, [\d.]+ MB of "
        r"kept prompts; compiled the decode step over 1, 4 rows and prefills of width 8, 16"
    )
    assert re.search(started, log.read_text())


def test_what_current_clients_send(server, tiny):
    """Content as a list of text parts, the developer role, max_completion_tokens, a model
    looked up by id and prompts as token ids: each means what its older form means."""
    url, _ = server
    tokenizer = PretrainedTokenizer.from_checkpoint(str(tiny))
    ids = [tokenizer.start_id, *tokenizer.pieces(["the"])[0]]
    texts = [
        c.text
        for prompt in ("the", ids, [ids, ids])
        for c in client(url).completions.create(model="tiny.gguf", prompt=prompt, max_tokens=6, temperature=0).choices
    ]
    assert len(texts) == 4 and len(set(texts)) == 1
    ask = dict(model="tiny.gguf", max_tokens=6, temperature=0)
    older = [{"role": "system", "content": "Be brief.\nAlways."}, {"role": "user", "content": "hi there"}]
    newer = [
        {"role": "developer", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Always."}]},
        {"role": "user", "content": [{"type": "text", "text": "hi there"}]},
    ]
    said = [client(url).chat.completions.create(messages=m, **ask).choices[0].message.content for m in (older, newer)]
    assert said[0] == said[1]
    fixed = dict(model="tiny.gguf", messages=older, temperature=0, extra_body={"min_tokens": 5})
    answer = client(url).chat.completions.create(**fixed, max_completion_tokens=5)
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
    assert client(url).models.retrieve("tiny.gguf").id == "tiny.gguf"
    with pytest.raises(openai.NotFoundError):
        client(url).models.retrieve("gpt-9")
    refused = [
        ({"prompt": "a", "max_tokens": 4, "max_completion_tokens": 4}, "/v1/completions", "max_completion_tokens"),
        ({"prompt": "a", "max_completion_tokens": 500}, "/v1/completions", "max_completion_tokens"),
        ({"prompt": [1, 10**6]}, "/v1/completions", "prompt"),
        ({"prompt": [[1], [-1]]}, "/v1/completions", "prompt.1"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "/v1/chat/completions",
            "messages.0.content.0.type",
        ),
    ]
    for body, path, param in refused:
        response = httpx.post(f"{url}{path}", json=body, headers=auth())
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_log_probabilities_in_both_shapes_streamed_or_not(server):
    """Greedy tokens with their log-probabilities: the chosen one first among its alternatives,
    sorted, summing below 1; the stream carries the same, chunk by chunk; the legacy shape lists
    one per token with its text's offset; bad values are named."""
    url, _ = server
    ask = dict(model="tiny.gguf", messages=[{"role": "user", "content": "hi"}], max_tokens=6, temperature=0)
    answer = client(url).chat.completions.create(**ask, logprobs=True, top_logprobs=3, extra_body={"min_tokens": 6})
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 6
    for item in content:
        ranked = [t.logprob for t in item.top_logprobs]
        assert len(ranked) == 3 and ranked == sorted(ranked, reverse=True) and ranked[0] == item.logprob <= 0
        assert sum(np.exp(ranked)) <= 1 + 1e-6 and item.top_logprobs[0].token == item.token
    reused = metric(url, "apps_prompt_tokens_reused", model="tiny.gguf")
    chunks = client(url).chat.completions.create(
        **ask, logprobs=True, top_logprobs=3, extra_body={"min_tokens": 6}, stream=True
    )
    streamed = [item for c in chunks if c.choices and c.choices[0].logprobs for item in c.choices[0].logprobs.content]
    # (The second request reads its prompt's keys from the first's, kept: equal to float32 rounding.)
    assert [i.token for i in streamed] == [i.token for i in content]
    np.testing.assert_allclose([i.logprob for i in streamed], [i.logprob for i in content], atol=1e-5)
    assert metric(url, "apps_prompt_tokens_reused", model="tiny.gguf") - reused == answer.usage.prompt_tokens - 1
    legacy = client(url).completions.create(model="tiny.gguf", prompt="the", max_tokens=5, temperature=0, logprobs=2)
    scored = legacy.choices[0].logprobs
    assert len(scored.token_logprobs) == len(scored.top_logprobs) == len(scored.text_offset) == 5
    assert scored.text_offset[0] == 0 and scored.text_offset == sorted(scored.text_offset)
    plain = client(url).completions.create(model="tiny.gguf", prompt="the", max_tokens=5, temperature=0)
    assert plain.choices[0].logprobs is None and plain.choices[0].text == legacy.choices[0].text
    for body, path, param in [
        ({"messages": ask["messages"], "top_logprobs": 2}, "/v1/chat/completions", "top_logprobs"),
        ({"messages": ask["messages"], "logprobs": True, "top_logprobs": 21}, "/v1/chat/completions", "top_logprobs"),
        ({"prompt": "a", "logprobs": 21}, "/v1/completions", "logprobs"),
        ({"prompt": "a", "logprobs": True}, "/v1/completions", "logprobs"),
    ]:
        response = httpx.post(f"{url}{path}", json=body, headers=auth())
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_logit_bias_and_penalties_steer_the_answer(server, tiny):
    """A token biased by +100 is every token greedy decoding gives, one biased by -100 never
    comes; a frequency penalty makes a greedy answer repeat itself less; bad values are named."""
    url, _ = server
    tokenizer = PretrainedTokenizer.from_checkpoint(str(tiny))
    ask = dict(model="tiny.gguf", prompt="the", max_tokens=12, temperature=0)
    plain = client(url).completions.create(**ask, logprobs=0).choices[0]
    forced = tokenizer.pieces(["cat"])[0][-1]
    answer = client(url).completions.create(**ask, logit_bias={str(forced): 100}).choices[0]
    assert answer.text == tokenizer.decode([forced] * 12)
    first = plain.logprobs.tokens[0]
    banned = next(i for i in range(tokenizer.vocab_size) if tokenizer.decode([i]) == first)
    avoided = client(url).completions.create(**ask, logprobs=0, logit_bias={str(banned): -100}).choices[0]
    assert first not in avoided.logprobs.tokens and avoided.text != plain.text
    varied = client(url).completions.create(**ask, logprobs=0, frequency_penalty=2.0).choices[0]
    assert len(set(varied.logprobs.tokens)) > len(set(plain.logprobs.tokens))
    for body, param in [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {str(10**6): 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
    ]:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", **body}, headers=auth())
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


# Every string bounded in bytes (a pattern), so that any answer ends within the tiny model's context.
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z]{1,6}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "mood": {"enum": ["calm", "glad", "tired"]},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,5}$"}, "maxItems": 2},
    },
    "required": ["name", "age", "mood", "tags"],
    "additionalProperties": False,
}


ENDLESS = {
    "$ref": "#/$defs/node",
    "$defs": {"node": {"type": "object", "properties": {"child": {"$ref": "#/$defs/node"}}, "required": ["child"]}},
}


def test_structured_answers_parse_and_follow_their_schema(server, tiny):
    """Twenty prompts, greedy and sampled, completions and chat, all at once, each answer kept to
    a JSON schema: every one parses, validates and ends with its grammar ("stop"); a json_object
    answer is a JSON object; a plain request among them answers as it does alone; bad formats
    are refused by name."""
    import concurrent.futures

    import jsonschema

    url, _ = server
    person = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    plain_ask = dict(model="tiny.gguf", prompt="the", max_tokens=12, temperature=0)
    alone = client(url).completions.create(**plain_ask).choices[0].text

    def ask(i: int):
        sampling = dict(temperature=0) if i % 2 else dict(temperature=1.0, seed=i)
        if i % 3 == 0:
            messages = [{"role": "user", "content": f"p{i}"}]
            answer = client(url).chat.completions.create(
                model="tiny.gguf", messages=messages, max_tokens=100, response_format=person, **sampling
            )
            return answer.choices[0].message.content, answer.choices[0].finish_reason
        answer = client(url).completions.create(
            model="tiny.gguf", prompt=f"p{i}", max_tokens=100, extra_body={"response_format": person}, **sampling
        )
        return answer.choices[0].text, answer.choices[0].finish_reason

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        plain_answer = pool.submit(lambda: client(url).completions.create(**plain_ask).choices[0].text)
        answers = list(pool.map(ask, range(20)))
    for text, reason in answers:
        jsonschema.validate(json.loads(text), PERSON)
        assert reason == "stop", text
    assert len({text for text, _ in answers}) > 5 and plain_answer.result() == alone
    closing = PretrainedTokenizer.from_checkpoint(str(tiny)).pieces(["}"])[0][-1]
    anything = client(url).chat.completions.create(
        model="tiny.gguf",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_object"},
        extra_body={"logit_bias": {str(closing): 30}},  # "}" pushed up: the object closes within the tokens
    )
    assert isinstance(json.loads(anything.choices[0].message.content), dict)
    for body, param in [
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        # No answer can end: each node requires a child node. Refused before any work, not a 500.
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ENDLESS}}},
            "response_format",
        ),
    ]:
        response = httpx.post(f"{url}/v1/completions", json={"prompt": "a", **body}, headers=auth())
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert "no answer can complete the grammar" in response.json()["error"]["message"]


def test_embeddings_are_the_models_mean_pooled_states_alone_or_batched(server, tiny):
    """Each input's embedding is the mean of the decoder's last states over its prompt ids (as
    `apps embed` reads them in process), at unit length; the same alone, batched with others,
    concurrent, from token ids and in base64; a sentiment run's from its encoder; bad values
    are named."""
    import base64
    import concurrent.futures

    from core.options import predict_option_values
    from core.predict import Predictor
    from tasks.nlp.lm import LMTask
    from tasks.nlp.sentiment import SentimentTask

    url, log = server
    texts = ["the cat sat", "a", "the the the"]
    local = Predictor(LMTask, model=str(tiny))
    examples = local.task.parse_request(texts, predict_option_values(local.task, {}))
    expected = [v / np.linalg.norm(v) for v in local.task.embed(local.model, local.featurizer, examples)]
    together = client(url).embeddings.create(model="tiny.gguf", input=texts)
    assert [d.index for d in together.data] == [0, 1, 2] and together.model == "tiny.gguf"
    ids = [local.featurizer.prompt(e) for e in examples]
    assert together.usage.prompt_tokens == sum(map(len, ids))
    for got, want in zip(together.data, expected):
        np.testing.assert_allclose(got.embedding, want, atol=1e-5)
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        alone = list(pool.map(lambda t: client(url).embeddings.create(model="tiny.gguf", input=t).data[0], texts))
    np.testing.assert_allclose([a.embedding for a in alone], [d.embedding for d in together.data], atol=1e-5)
    from_ids = client(url).embeddings.create(model="tiny.gguf", input=ids, dimensions=len(expected[0]))
    np.testing.assert_allclose([d.embedding for d in from_ids.data], expected, atol=1e-5)
    raw = httpx.post(
        f"{url}/v1/embeddings",
        json={"model": "tiny.gguf", "input": texts[0], "encoding_format": "base64"},
        headers=auth(),
    ).json()["data"][0]["embedding"]
    np.testing.assert_allclose(np.frombuffer(base64.b64decode(raw), "<f4"), expected[0], atol=1e-5)
    # A sentiment run's: the mean of its encoder's last states over each text's tokens.
    sentiment = Predictor(SentimentTask, workdir=log.parent / "sentiment")  # beside the server's log
    states = sentiment.task.embed(sentiment.model, sentiment.featurizer, sentiment.task.parse_inputs(texts, {}))
    encoded = client(url).embeddings.create(model="sentiment", input=texts)
    np.testing.assert_allclose([d.embedding for d in encoded.data], [v / np.linalg.norm(v) for v in states], atol=1e-5)
    for body, status, param in [
        ({"model": "tiny.gguf", "input": "a", "dimensions": 3}, 400, "dimensions"),
        ({"model": "tiny.gguf", "input": []}, 400, "input"),
        ({"model": "tiny.gguf", "input": [[1], [10**6]]}, 400, "input.1"),
        ({"model": "tiny.gguf", "input": [[1], [1] * 5000]}, 400, "input.1"),  # past --context: refused unread
        ({"model": "tiny.gguf", "input": [[1] * 5000], "dimensions": 3}, 400, "dimensions"),
        ({"input": [[1]], "model": "sentiment"}, 400, "input"),
        ({"input": "a", "model": "nobody"}, 404, "model"),
        ({"input": "a"}, 400, "model"),  # two served models embed: which one
        ({"model": "tiny.gguf", "input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
    ]:
        response = httpx.post(f"{url}/v1/embeddings", json=body, headers=auth())
        assert response.status_code == status and response.json()["error"]["param"] == param, response.text
        if param == "input.1" and len(body["input"][1]) == 5000:
            assert "5000 tokens, more than the" in response.json()["error"]["message"]


def test_the_embeddings_benchmark_counts_what_the_server_embedded(server, monkeypatch):
    from core.serving import embedding_load as embed_bench

    url, _ = server
    monkeypatch.setattr(embed_bench, "TEXTS", ("the cat", "a b c d"))  # the tiny model reads 128 positions
    figures = embed_bench.run_embeddings(f"{url}/v1", "tiny.gguf", clients=2, per_request=3, seconds=1.0, api_key=KEY)
    assert figures["requests"] >= 2 and figures["texts/s"] == pytest.approx(figures["requests"] * 3)
    assert 0 < figures["p50 latency"] < 1


def test_a_stop_sequence_and_seeded_sampling(server):
    url, _ = server
    whole = client(url).completions.create(model="tiny.gguf", prompt="a b c", max_tokens=10, temperature=0).choices[0]
    stop = whole.text[3:5]
    cut = client(url).completions.create(model="tiny.gguf", prompt="a b c", max_tokens=10, temperature=0, stop=[stop])
    assert cut.choices[0].text == whole.text[: whole.text.index(stop)] and cut.choices[0].finish_reason == "stop"
    drawn = [
        client(url).completions.create(model="tiny.gguf", prompt="x", max_tokens=12, temperature=1.0, seed=5, n=3)
        for _ in range(2)
    ]
    assert [c.text for c in drawn[0].choices] == [c.text for c in drawn[1].choices]  # a seed repeats
    assert len({c.text for c in drawn[0].choices}) > 1  # each of n draws with its own seed


def test_min_tokens_holds_the_end_tokens_back(server):
    """The same seeded draws with and without min_tokens: the answers that drew an end token stop
    there without it, and draw another token there with it, running on to max_tokens, as they
    do with ignore_eos."""
    request = {"model": "tiny.gguf", "prompt": "x", "max_tokens": 100, "temperature": 2.0, "seed": 1, "n": 16}
    natural = client(url := server[0]).completions.create(**request)
    ended = [c for c in natural.choices if c.finish_reason == "stop"]
    assert ended and natural.usage.completion_tokens < 16 * 100
    fixed = client(url).completions.create(**request, extra_body={"min_tokens": 100})
    assert {c.finish_reason for c in fixed.choices} == {"length"} and fixed.usage.completion_tokens == 16 * 100
    ignored = client(url).completions.create(**request, extra_body={"ignore_eos": True})  # as vLLM, llama-server
    assert [c.text for c in ignored.choices] == [c.text for c in fixed.choices]
    for choice in ended:  # (less a piece of a character that the end token cut short)
        assert fixed.choices[choice.index].text.startswith(choice.text.rstrip("\ufffd"))


def test_concurrent_requests_share_decode_steps_and_give_what_each_gives_alone(server):
    url, _ = server
    ask = lambda prompt: (
        client(url)
        .completions.create(  # noqa: E731
            model="tiny.gguf", prompt=prompt, max_tokens=24, temperature=0
        )
        .choices[0]
        .text
    )
    alone = [ask(prompt) for prompt in PROMPTS]
    steps_before = metric(url, "apps_decode_slots_count", model="tiny.gguf")
    single_before = metric(url, "apps_decode_slots_bucket", le="1.0", model="tiny.gguf")
    together: list[str | None] = [None] * len(PROMPTS)

    def send(i):
        together[i] = ask(PROMPTS[i])

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert together == alone
    steps = metric(url, "apps_decode_slots_count", model="tiny.gguf") - steps_before
    single = metric(url, "apps_decode_slots_bucket", le="1.0", model="tiny.gguf") - single_before
    assert steps < len(PROMPTS) * 23 and single < steps  # steps ran several requests at once


def test_a_client_that_disconnects_frees_its_slots(server):
    url, _ = server
    before = metric(url, "apps_prefills", model="tiny.gguf")
    body = {"model": "tiny.gguf", "prompt": "the", "max_tokens": 120, "n": 16, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=auth(), timeout=30) as response:
        assert response.status_code == 200
        next(response.iter_lines())  # the first chunk, then hang up
    deadline = time.monotonic() + 20
    while metric(url, "apps_busy_slots", model="tiny.gguf") > 0:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    # The 12 choices still waiting for a slot were dropped unprefilled.
    assert metric(url, "apps_prefills", model="tiny.gguf") - before < 16


def test_clients_that_leave_unstreamed_requests_free_their_slots_within_a_second(server):
    """Sixty-four generations of 120 steps for four slots (sixteen rounds, seconds of work), asked
    by four clients that give up after a fifth of a second: the slots and the queue are empty
    within a second of their leaving, and the generations still waiting were never started."""
    url, log = server
    body = {"model": "tiny.gguf", "prompt": "the", "max_tokens": 120, "min_tokens": 120, "n": 16, "temperature": 0}
    before = {name: metric(url, name, model="tiny.gguf") for name in ("apps_prefills", "apps_generated_tokens_total")}
    gone = []

    def impatient():
        try:
            httpx.post(f"{url}/v1/completions", json=body, headers=auth(), timeout=0.2)
        except httpx.TimeoutException:
            gone.append(True)

    threads = [threading.Thread(target=impatient) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    left = time.monotonic()
    while metric(url, "apps_busy_slots", model="tiny.gguf") > 0 or metric(url, "apps_queue_depth", model="tiny.gguf"):
        assert time.monotonic() - left < 1.0, "the slots of clients that left were still busy after a second"
        time.sleep(0.02)
    assert len(gone) == 4
    time.sleep(0.5)  # the abandoned requests' futures collected
    assert "never retrieved" not in log.read_text()  # a client that leaves costs no log lines
    assert metric(url, "apps_prefills", model="tiny.gguf") - before["apps_prefills"] < 64
    made = metric(url, "apps_generated_tokens_total", model="tiny.gguf") - before["apps_generated_tokens_total"]
    assert made < 64 * 120


def test_a_stream_sends_no_part_of_a_stop_sequence(server):
    """Streamed and whole answers agree for stops that end the answer, that begin it and that
    never complete: what may begin a stop waits until the next tokens decide."""
    url, _ = server
    whole = client(url).completions.create(model="tiny.gguf", prompt="a b c", max_tokens=12, temperature=0)
    text = whole.choices[0].text
    for stop in [text[4:7], text[:3], text[-2:] + "\u00a7never"]:
        request = dict(model="tiny.gguf", prompt="a b c", max_tokens=12, temperature=0, stop=[stop])
        answer = client(url).completions.create(**request).choices[0].text
        streamed = "".join(c.choices[0].text for c in client(url).completions.create(**request, stream=True))
        assert streamed == answer == (text[: text.index(stop)] if stop in text else text)


def test_a_streams_latency_is_its_whole_length(server):
    url, _ = server
    before = metric(url, "apps_request_seconds_sum", endpoint="/v1/completions")
    started = time.perf_counter()
    request = dict(model="tiny.gguf", prompt="the", max_tokens=120, temperature=0, stream=True)
    first = None
    for _ in client(url).completions.create(**request, extra_body={"min_tokens": 120}):
        first = first or time.perf_counter() - started
    took = time.perf_counter() - started
    assert took > 2 * first  # the stream's length is mostly after its headers
    assert metric(url, "apps_request_seconds_sum", endpoint="/v1/completions") - before >= 0.8 * took - 0.05


def test_bad_texts_cost_one_status_and_no_log(server):
    url, log = server
    before = log.read_text()
    for _ in range(5):
        response = httpx.post(
            f"{url}/v1/chat/completions",
            content=b'{"messages": [{"role": "user", "content": "hi \\ud800"}]}',
            headers={**auth(), "content-type": "application/json"},
        )
        assert response.status_code == 400
    assert log.read_text() == before


def test_predict_batches_concurrent_requests_into_one_call(server):
    url, _ = server
    alone = httpx.post(f"{url}/v1/sentiment/predict", json={"inputs": ["great fit"]}, headers=auth()).json()
    assert alone["predictions"][0]["text"] == "great fit" and alone["predictions"][0]["label"] in (
        "positive",
        "negative",
    )
    calls_before = metric(url, "apps_batch_requests_count", model="sentiment")
    inputs = [["great fit", "awful"], ["lovely"], ["too small", "ok", "nice"]]
    answers: list = [None] * 3

    def send(i):
        answers[i] = httpx.post(f"{url}/v1/sentiment/predict", json={"inputs": inputs[i]}, headers=auth()).json()

    threads = [threading.Thread(target=send, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    for given, answer in zip(inputs, answers):
        assert [row["text"] for row in answer["predictions"]] == given
    assert metric(url, "apps_batch_requests_count", model="sentiment") - calls_before < 3


@pytest.mark.parametrize(
    "path, body, status, param",
    [
        ("/v1/completions", b"{not json", 400, "body"),
        ("/v1/completions", {"prompt": "a", "max_tokens": "many"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "bogus": 1}, 400, "bogus"),
        ("/v1/completions", {"prompt": ""}, 400, "prompt"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 500}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
        ("/v1/completions", {"prompt": "a", "model": "gpt-9"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages.0.role"),
        ("/v1/sentiment/predict", {"inputs": ["fine"], "options": {"beams": 2}}, 400, "options.beams"),
        ("/v1/sentiment/predict", {"inputs": "fine"}, 400, "inputs"),
        ("/v1/recsys/predict", {"inputs": ["1,2"]}, 404, "model"),
        ("/v1/completions", {"prompt": "a" * (5 * 1024 * 1024)}, 413, "body"),
        # JSON's types as given, as OpenAI's API takes them.
        ("/v1/completions", {"prompt": "a", "max_tokens": "10"}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "a", "max_tokens": True}, 400, "max_tokens"),
        # Half a surrogate pair is no text: named, never a 500.
        ("/v1/completions", b'{"prompt": "the \\ud800"}', 400, "prompt"),
        ("/v1/completions", b'{"prompt": ["the", "\\ud800"]}', 400, "prompt.1"),
        ("/v1/completions", b'{"prompt": "the", "stop": "\\udfff"}', 400, "stop"),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, "messages.0.content"),
        ("/v1/sentiment/predict", b'{"inputs": ["fine", "\\ud800"]}', 400, "inputs.1"),
        ("/v1/sentiment/predict", b'{"inputs": ["fine"], "options": {"x": "\\ud800"}}', 400, "options"),
        # ... in an object's keys too: a tool's parameters, a response format's schema.
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function", "function": '
            b'{"name": "f", "parameters": {"type": "object", "properties": {"\\ud800": {"type": "string"}}}}}]}',
            400,
            "tools.0.function.parameters",
        ),
        (
            "/v1/chat/completions",
            b'{"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "json_schema", '
            b'"json_schema": {"name": "x", "schema": {"properties": {"\\ud800": {"type": "string"}}}}}}',
            400,
            "response_format.json_schema.schema",
        ),
        ("/v1/completions", b'{"prompt": "\xff"}', 400, "body"),  # not UTF-8
        # More generations than the queue holds could never be served: not a 503 to retry.
        ("/v1/completions", {"prompt": ["a"] * 257}, 400, "prompt"),
        ("/v1/completions", {"prompt": ["a"] * 20, "n": 16}, 400, "n"),
        # Limits a deployment sets: inputs per request, positions per generation (the tiny
        # model's 128); a task's own check of an option named as the request names it.
        ("/v1/sentiment/predict", {"inputs": ["fine"] * 65}, 400, "inputs"),
        ("/v1/sentiment/predict", {"inputs": ["fine", "  "]}, 400, "inputs.1"),
        ("/v1/lm/predict", {"inputs": ["the"], "options": {"max_new_tokens": 500}}, 400, "inputs.0"),
        ("/v1/lm/predict", {"inputs": ["the"], "options": {"beams": 0}}, 400, "options.beams"),
        # Starlette's own refusals, in the same shape.
        ("/v1/nothing", {}, 404, None),
        ("/v1/models", {}, 405, None),
    ],
)
def test_each_bad_request_is_a_json_error_naming_its_field_and_the_server_goes_on(server, path, body, status, param):
    url, _ = server
    sent = {"content": body} if isinstance(body, bytes) else {"json": body}
    response = httpx.post(f"{url}{path}", headers={**auth(), "content-type": "application/json"}, **sent)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == status and error["message"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def test_a_body_of_unknown_length_is_refused(server):
    url, _ = server
    chunks = iter([b'{"prompt": ', b'"the"}'])  # sent chunked, without a Content-Length
    response = httpx.post(
        f"{url}/v1/completions", content=chunks, headers={**auth(), "content-type": "application/json"}
    )
    assert response.status_code == 411 and response.json()["error"]["param"] == "body"


def test_a_client_slow_to_send_its_head_or_body_is_cut_off_and_the_server_goes_on(server):
    url, _ = server  # --read-timeout 2
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    before = metric(url, "apps_requests_total", endpoint="/v1/completions", status="408")
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {KEY}\r\nContent-Length: 1000\r\n\r\n"
    )
    started = time.monotonic()
    with socket.create_connection(address, timeout=20) as half, socket.create_connection(address, timeout=20) as short:
        half.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # never the blank line that ends the head
        short.sendall(head.encode() + b'{"prompt":')  # 10 of the 1,000 bytes promised
        answer, closed = until_closed(short), until_closed(half)
    assert time.monotonic() - started < 8  # both cut off after 2 s, not held
    assert closed == b""
    status, _, body = answer.partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 408") and b"connection: close" in status.lower()
    error = json.loads(body)["error"]
    assert (error["code"], error["param"], error["type"]) == (408, "body", "timeout")
    assert metric(url, "apps_requests_total", endpoint="/v1/completions", status="408") == before + 1
    assert httpx.get(f"{url}/health").json()["status"] == "ok"
    answer = client(url).completions.create(model="tiny.gguf", prompt="the", max_tokens=2, temperature=0)
    assert answer.choices[0].finish_reason == "length"


def test_what_a_careless_client_sends_is_read_as_openai_reads_it(server):
    """A body without a Content-Type, or with curl's default form type, is read as JSON; a
    message's `name` is taken; a Content-Length that is no number gets an OpenAI-shaped 400."""
    url, _ = server
    message = {"role": "user", "name": "ann", "content": "hi"}
    body = json.dumps({"model": "tiny.gguf", "messages": [message], "max_tokens": 2, "temperature": 0})
    for content_type in (None, "application/x-www-form-urlencoded", "text/plain"):
        headers = {**auth(), **({"content-type": content_type} if content_type else {})}
        response = httpx.post(f"{url}/v1/chat/completions", content=body.encode(), headers=headers)
        assert response.status_code == 200, (content_type, response.text)
    address = ("127.0.0.1", int(url.rsplit(":", 1)[1]))
    with socket.create_connection(address, timeout=20) as connection:
        connection.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n{}")
        status, _, answer = until_closed(connection).partition(b"\r\n\r\n")
    assert status.startswith(b"HTTP/1.1 400") and b"application/json" in status
    error = json.loads(answer)["error"]
    assert error["code"] == 400 and "a Content-Length must be a number" in error["message"]
    assert httpx.get(f"{url}/health").json()["status"] == "ok"


def until_closed(connection: socket.socket) -> bytes:
    """What the server sent on `connection` until it closed it."""
    received = b""
    while chunk := connection.recv(65536):
        received += chunk
    return received


def test_the_key_is_required_everywhere_but_health(server):
    url, _ = server
    assert httpx.get(f"{url}/health").status_code == 200
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        response = httpx.get(f"{url}/v1/models", headers=headers)
        assert response.status_code == 401 and response.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{url}/metrics", headers={}).status_code == 401
    assert httpx.get(f"{url}/v1/models", headers=auth()).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0).models.list()


def test_serving_beyond_loopback_needs_a_key_and_an_unknown_dtype_is_refused(tmp_path, tiny):
    result = apps("serve", "--model", tiny, "--host", "0.0.0.0")
    assert result.exit_code == 1 and "give --api-key" in " ".join(result.output.split())
    result = apps("serve", "--model", tiny, "--dtype", "float16")
    assert result.exit_code == 1 and "--dtype float16: expected float32, bfloat16, int8 or int4" in " ".join(
        result.output.split()
    )
    result = apps("serve", "--model", "no-such-model")  # named with the checkpoints it could serve
    assert result.exit_code == 1, result.output
    assert "--model no-such-model: not a checkpoint this server runs. Shipped: gemma3-270m, " in plain(result.output)
    assert "whisper-tiny.en" in plain(result.output)
    result = apps("predict", "lm", "--model", "whisper-tiny.en", "hello")
    assert result.exit_code == 1 and "whisper-tiny.en is not a decoder (a causal" in plain(result.output)
    result = apps("serve", "--model", tiny, "--read-timeout", "0")
    assert result.exit_code == 1 and "--read-timeout and --max-audio-seconds positive" in plain(result.output)
    result = apps("serve", "--model", tiny, "--prompt-cache", "-1")
    assert result.exit_code == 1 and "--max-wait-ms and --prompt-cache at least 0" in plain(result.output)


def test_a_full_queue_is_503_and_sigterm_finishes_the_requests_in_flight_then_exits(tmp_path, tiny):
    with serving(tmp_path, "--model", str(tiny), "--max-batch", "1", "--queue", "4", key=None) as (process, url, log):
        result = {}

        def long_request():
            body = {"prompt": "the", "max_tokens": 120, "min_tokens": 120, "n": 4, "temperature": 0}
            result["response"] = httpx.post(f"{url}/v1/completions", json=body, timeout=120)

        thread = threading.Thread(target=long_request)
        thread.start()
        while metric(url, "apps_busy_slots", model="tiny.gguf") == 0:
            assert thread.is_alive()
            time.sleep(0.01)
        # One choice in the slot, three waiting: four more do not fit beside any of them (so the
        # answer holds until the last of the three has taken the slot, on a loaded machine too).
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "the", "max_tokens": 120, "n": 4}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["type"] == "overloaded"
        # Five could never wait together, however idle the server: no retry would help.
        never = httpx.post(f"{url}/v1/completions", json={"prompt": "the", "max_tokens": 120, "n": 5}, timeout=60)
        assert never.status_code == 400 and never.json()["error"]["param"] == "n"
        process.send_signal(signal.SIGTERM)
        # Drained, uvicorn raises the signal again: the process ends as SIGTERM's, as a scheduler expects.
        assert process.wait(120) == -signal.SIGTERM, log.read_text()[-3000:]
        thread.join(10)
    response = result["response"]
    assert response.status_code == 200
    assert [c["finish_reason"] for c in response.json()["choices"]] == ["length"] * 4
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{url}/health", timeout=2)


def test_a_request_past_the_timeout_is_504_and_frees_its_slots(tmp_path, tiny):
    with serving(tmp_path, "--model", str(tiny), "--max-batch", "1", "--timeout", "0.3", key=None) as (_, url, _):
        body = {"prompt": "the", "max_tokens": 120, "n": 12, "temperature": 0}  # 1,440 steps in one slot
        response = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
        assert response.status_code == 504 and response.json()["error"]["type"] == "timeout"
        deadline = time.monotonic() + 20
        while metric(url, "apps_busy_slots", model="tiny.gguf") > 0:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert metric(url, "apps_prefills", model="tiny.gguf") < 12  # the waiting choices were dropped


def test_a_request_never_names_a_file_on_the_server(tmp_path):
    fasta = tmp_path / "secret.fasta"
    fasta.write_text(">secret\nMKTAYIAKQR\n")
    task = ProteinClassTask.__new__(ProteinClassTask)
    object.__setattr__(task, "data", None)
    assert task.parse_inputs([str(fasta)], {})[0]["sequence"] == "MKTAYIAKQR"  # the CLI reads the user's files
    served = task.parse_request([str(fasta)], {})  # the server takes the text as a sequence, never opens it
    assert [r["id"] for r in served] == ["input 1"] and served[0]["sequence"] == str(fasta).upper()


def wav_base64(samples) -> str:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, 16_000, format="WAV", subtype="PCM_16")
    return base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.slow
def test_every_task_predicts_over_http_what_apps_predict_prints(tmp_path):
    """A tiny run of every task behind one server: each predict endpoint answers the rows that
    the in-process Predictor (what `apps predict` prints) gives for the same input; speech's
    base64 upload gives what the same audio as a file gives."""
    clip = (0.3 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000)).astype(np.float32)
    wav = tmp_path / "tone.wav"
    soundfile.write(wav, clip, 16_000, subtype="PCM_16")
    given = {
        "lm": ["The small fox"],
        "sentiment": ["the dress was beautiful"],
        "translate": ["big red dog"],
        "summarize": ["big sleeps cat dog red"],
        "recsys": ["25,26,27"],
        "protein-mlm": ["WCSIHH?YLGGNPSSH"],
        "protein-class": ["WCSIHHSYLGGNPSSH"],
        "protein-residue": ["WCSIHHSYLGGNPSSH"],
        "speech": [str(wav)],
    }
    workdirs = []
    for name in sorted(tasks.REGISTRY):
        workdir = tmp_path / name
        run.train(tasks.get(name), workdir=workdir, preset="tiny", data="synthetic", overrides=["train.steps=4"])
        workdirs += ["--workdir", str(workdir)]
    with serving(tmp_path, *workdirs, "--max-audio-seconds", "1") as (_, url, _):
        long_clip = {"inputs": [wav_base64(np.concatenate([clip] * 3))]}  # 1.5 s
        refused = httpx.post(f"{url}/v1/speech/predict", json=long_clip, headers=auth(), timeout=60)
        assert refused.status_code == 400
        assert "input 1: 1.5 s of audio, more than the 1 s a file may last here" in refused.json()["error"]["message"]
        garbage = {"inputs": [base64.b64encode(b"not audio at all").decode()]}
        refused = httpx.post(f"{url}/v1/speech/predict", json=garbage, headers=auth(), timeout=60)
        assert refused.status_code == 400 and "Format not recognised" in refused.text and "0x" not in refused.text
        for name, inputs in given.items():
            options = {"max_new_tokens": 8} if name == "lm" else {}  # the tiny lm has 32 positions
            expected = run.Predictor(tasks.get(name), tmp_path / name).predict(inputs, **options)
            body = {"inputs": [wav_base64(clip)] if name == "speech" else inputs, "options": options}
            response = httpx.post(f"{url}/v1/{name}/predict", json=body, headers=auth(), timeout=120)
            assert response.status_code == 200, (name, response.text)
            rows = response.json()["predictions"]
            if name == "speech":
                assert rows == [{**expected[0], "file": "input 1"}]
            else:
                assert rows == expected, name


def test_the_load_benchmark_counts_within_its_window_and_frees_the_slots_it_cuts_off(server, monkeypatch):
    url, _ = server
    monkeypatch.setattr(serve_bench, "PROMPTS", ("the", "a b c"))  # the tiny model reads 128 positions
    monkeypatch.setattr(serve_bench, "MAX_TOKENS", (8, 20))
    assert [serve_bench.job(n) for n in range(5)] == [("the", 8), ("a b c", 8), ("the", 20), ("a b c", 20), ("the", 8)]
    before = metric(url, "apps_generated_tokens_total", model="tiny.gguf")
    figures = serve_bench.run_load(f"{url}/v1", "tiny.gguf", clients=3, seconds=2.0, api_key=KEY)
    assert figures["clients"] == 3 and figures["requests"] >= 3
    assert figures["tokens/s"] * figures["seconds"] == pytest.approx(figures["tokens"])
    assert figures["requests/s"] * figures["seconds"] == pytest.approx(figures["requests"])
    assert 0 < figures["p50 first token"] <= figures["p99 first token"] <= figures["p99 latency"]
    deadline = time.monotonic() + 30
    while metric(url, "apps_busy_slots", model="tiny.gguf") > 0:  # the answers cut off free their slots
        assert time.monotonic() < deadline, "a slot of a cut-off answer was never freed"
        time.sleep(0.1)
    # Within the window: never more than the server made, which went on past it for the cut answers.
    # The server counts a cut answer when it sees the client gone, which may come after its slot is freed.
    while (made := metric(url, "apps_generated_tokens_total", model="tiny.gguf") - before) < figures["tokens"]:
        assert time.monotonic() < deadline, f"the benchmark counted {figures['tokens']} tokens, the server {made}"
        time.sleep(0.1)


def test_the_load_benchmark_counts_streamed_pieces_from_a_server_that_sends_no_usage():
    """llama-cpp-python's server ignores stream_options and sends no usage: the benchmark then
    counts the chunks that carry text (one token each there), and none of the others; an answer
    streaming at the end of the window counts the pieces it had by then."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            assert self.path == "/v1/completions"
            self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            try:
                for text in ["", "Hel", "lo", "!", ""]:
                    chunk = {"choices": [{"index": 0, "text": text}]}
                    self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
                    self.wfile.flush()
                    time.sleep(0.05)
                self.wfile.write(b"data: [DONE]\n\n")
            except (BrokenPipeError, ConnectionResetError):  # the client cut it off
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        figures = serve_bench.run_load(f"http://127.0.0.1:{server.server_port}/v1", "m", clients=2, seconds=1.5)
    finally:
        server.shutdown()
    assert figures["requests"] >= 2 and figures["cut"] <= 2
    assert 0 <= figures["tokens"] - 3 * figures["requests"] <= 3 * figures["cut"]


def test_the_load_benchmark_serves_a_trained_run_at_its_slots_and_at_one(tmp_path, monkeypatch):
    workdir = tmp_path / "lm"
    run.train(tasks.get("lm"), workdir=workdir, preset="tiny", data="synthetic", overrides=["train.steps=2"])
    monkeypatch.setattr(serve_bench, "PROMPTS", ("the", "a b c"))  # the tiny lm reads 32 positions
    monkeypatch.setattr(serve_bench, "MAX_TOKENS", (4, 8))
    assert apps("bench", "serve", "--workdir", workdir, "--model", "x").exit_code == 1
    figures = tmp_path / "serve.json"
    command = ["bench", "serve", "--workdir", workdir, "--clients", 1, "--seconds", 2, "--slots", 2, "--json", figures]
    result = apps(*command, "--fixed-lengths", "--dtype", "bfloat16")
    assert result.exit_code == 0, result.output
    rows = json.loads(figures.read_text())["serve"]
    assert [row["server"] for row in rows] == ["apps serve, 2 slots", "apps serve, 1 slot"]
    assert all(row["requests"] >= 1 and row["tokens"] >= 1 for row in rows), rows
    # Every answer at its length: one client's finished requests wrote the mix's max_tokens, and
    # the one cut off at the end fewer than its own; the servers' weights in bfloat16.
    assert "bfloat16 weights" in plain(result.output)
    for row in rows:
        finished = sum(serve_bench.job(n)[1] for n in range(row["requests"]))
        assert finished <= row["tokens"] < finished + serve_bench.job(row["requests"])[1] * row["cut"] + 1
