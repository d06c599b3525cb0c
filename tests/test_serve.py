"""scripts/serve.py: the OpenAI-compatible server, started on a free loopback port with the tiny model and a
word-level tokenizer, driven by the official `openai` client: chat and completions, streaming or not, several
requests at once; greedy answers equal `generate`'s token for token; a client that leaves mid-stream frees its
row; bad requests get OpenAI's error JSON with a 4xx status while the server serves on; SIGTERM drains."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from starlette.testclient import TestClient

from medusa_jax.text import chat_prompt_ids, decode_tokens, eos_token_ids, load_tokenizer
from medusa_jax.hf.load import load_pretrained
from medusa_jax.trees.tree import load_tree
from medusa_jax.inference.api import generate
from medusa_jax.inference.generation_engine import EngineConfig, GenerationEngine
from medusa_jax.inference.engine_requests import RequestParams
from medusa_jax.inference.openai_server import OpenAIServer
from tokenizers import Tokenizer, models, pre_tokenizers

SERVE = Path(__file__).resolve().parents[1] / "scripts" / "serve.py"
ROWS, CONTEXT = 3, 256
CHAT_TEMPLATE = ("{% for m in messages %}w1 {{ m['role'] }} w2 {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}w1 assistant w2 {% endif %}")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tiny_model_dir, tmp_path_factory):
    """The tiny llama (vocab 128) with a word-level tokenizer that spells every id as one word (w0 .. w124, the
    roles, EOS </s> = 2), so an answer's text shows its tokens one for one."""
    import shutil

    import transformers

    dst = tmp_path_factory.mktemp("tiny-serve") / "model"
    shutil.copytree(tiny_model_dir("llama"), dst)
    words = ["user", "assistant", "</s>", "system"] + [f"w{i}" for i in range(124)]
    core = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=core, eos_token="</s>")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(dst)
    return dst


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def metrics(base: str) -> dict[str, float]:
    lines = httpx.get(f"{base}/metrics", timeout=10).text.splitlines()
    return {name: float(value) for name, value in (l.rsplit(" ", 1) for l in lines if not l.startswith("#"))}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, SERVE.parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextlib.contextmanager
def running_server(args: list[str], env: dict[str, str], wait: float = 300):
    """(base URL, process) of `serve.py ARGS` on a free loopback port, once /health answers; stopped (SIGTERM,
    then kill) at the end unless a test stopped it."""
    port = free_port()
    process = subprocess.Popen([sys.executable, str(SERVE), *args, "--port", str(port)], env={**os.environ, **env},
                               stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        assert process.poll() is None, process.stderr.read()
        yield base, process
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


@pytest.fixture(scope="module")
def server(tiny_with_tokenizer):
    """(base URL, process) of a server on a free loopback port; stopped (SIGTERM, then kill) at the end."""
    with running_server(["--model", str(tiny_with_tokenizer), "--batch-size", str(ROWS), "--context", str(CONTEXT),
                         "--chunk-steps", "4", "--max-queue", "16"], {"JAX_PLATFORMS": "cpu"}) as running:
        yield running


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server[0]}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_with_tokenizer):
    """greedy(prompt ids, max tokens) -> generate's tokens, with the folder's EOS ids."""
    tokenizer = load_tokenizer(tiny_with_tokenizer)
    model, eos = load_pretrained(tiny_with_tokenizer), eos_token_ids(tiny_with_tokenizer, tokenizer)

    def greedy(ids, max_tokens):
        return generate(model, [ids], max_new_tokens=max_tokens, eos_ids=eos)[0].token_ids

    return tokenizer, greedy


def long_answer(greedy, prompts_ids, max_tokens: int = 12):
    """The first of these prompts whose greedy answer runs to max_tokens (a random model may stop at once)."""
    return next(ids for ids in prompts_ids if len(greedy(ids, max_tokens)) == max_tokens)


CANDIDATES = [f"w{i} w{2 * i} w{3 * i}" for i in range(1, 30)]
MODEL = "model"  # the tiny folder's name (the fixture copies it to .../model)


def test_greedy_answers_equal_generate(client, reference):
    """Completions and chat, streamed or not: the text is `generate`'s tokens decoded, and the usage counts them."""
    tokenizer, greedy = reference
    prompt = tokenizer.decode(long_answer(greedy, [tokenizer(p)["input_ids"] for p in CANDIDATES]))
    want = greedy(tokenizer(prompt)["input_ids"], 12)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0)
    assert whole.choices[0].text == decode_tokens(tokenizer, want)
    assert whole.usage.completion_tokens == len(want) and whole.usage.prompt_tokens == 3
    assert whole.choices[0].finish_reason == "length"
    pieces = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                            stream=True))
    assert "".join(p.choices[0].text for p in pieces) == whole.choices[0].text and len(pieces) >= 3
    assert len(whole.choices[0].text.split(" ")) == 12  # every token is a word: the text shows them one for one
    assert pieces[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    messages = [{"role": "system", "content": "w7"}, {"role": "user", "content": "w5 w6 w9"}]
    want = greedy(chat_prompt_ids(tokenizer, messages), 20)  # any length: EOS included or not
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert chat.choices[0].message.content == decode_tokens(tokenizer, want)
    assert chat.usage.completion_tokens == len(want)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want)
    by_ids = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == decode_tokens(tokenizer, greedy([5, 6, 7, 8], 6))


def test_concurrent_mixed_requests_each_get_their_own_answer(server, client, reference):
    """Eight clients at once on three rows (the rest queue): greedy ones get `generate`'s answer, sampled ones the
    answer their seed gives alone; streaming and not mixed."""
    tokenizer, greedy = reference
    prompts = [" ".join(f"w{(7 * i + j) % 90 + 1}" for j in range(2 + i)) for i in range(8)]

    def ask(i):
        settings = dict(model=MODEL, prompt=prompts[i], max_tokens=10 + i, temperature=0 if i % 2 else 0.9,
                        seed=100 + i)
        if i % 3 == 0:
            return "".join(p.choices[0].text for p in client.completions.create(stream=True, **settings))
        return client.completions.create(**settings).choices[0].text

    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(ask, range(8)))
    for i in range(1, 8, 2):
        assert together[i] == decode_tokens(tokenizer, greedy(tokenizer(prompts[i])["input_ids"], 10 + i))
    assert [ask(i) for i in range(0, 8, 2)] == together[0::2]  # seeded sampling: the same alone
    stats = metrics(server[0])
    assert stats["medusa_rows_busy"] == 0 and stats["medusa_queue_depth"] == 0
    assert stats["medusa_time_to_first_token_seconds_count"] >= 12 and stats["medusa_accepted_tokens_per_step"] == 1


def test_metrics_count_requests_tokens_and_first_tokens(server, client):
    """/metrics in Prometheus text: every metric the issue names is there, and two answered requests move the
    request, token, step and time-to-first-token counters by exactly their own counts."""
    text = httpx.get(f"{server[0]}/metrics", timeout=10).text
    for name, kind in (("medusa_requests_total", "counter"), ("medusa_generation_tokens_total", "counter"),
                       ("medusa_prompt_tokens_total", "counter"), ("medusa_accepted_tokens_per_step", "gauge"),
                       ("medusa_queue_depth", "gauge"), ("medusa_rows_busy", "gauge"),
                       ("medusa_time_to_first_token_seconds", "histogram")):
        assert f"# TYPE {name} {kind}\n" in text
    before = metrics(server[0])
    whole = client.completions.create(model=MODEL, prompt="w4 w5", max_tokens=5, temperature=0)
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "w8"}],
                                                   max_tokens=7, temperature=0, stream=True,
                                                   stream_options={"include_usage": True}))
    after = metrics(server[0])
    usages = (whole.usage, streamed[-1].usage)

    def grew(name):
        return after.get(name, 0) - before.get(name, 0)

    assert grew("medusa_requests_total") == 2 and grew("medusa_time_to_first_token_seconds_count") == 2
    assert grew("medusa_generation_tokens_total") == sum(u.completion_tokens for u in usages)
    assert grew("medusa_prompt_tokens_total") == sum(u.prompt_tokens for u in usages)
    assert grew('medusa_requests_finished_total{reason="length"}') + \
        grew('medusa_requests_finished_total{reason="stop"}') == 2
    assert grew("medusa_time_to_first_token_seconds_sum") > 0 and grew("medusa_decode_steps_total") >= 1


def test_stop_strings_end_the_text(client, reference):
    tokenizer, greedy = reference
    prompt = tokenizer.decode(long_answer(greedy, [tokenizer(p)["input_ids"] for p in CANDIDATES[::-1]]))
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    words = full.split(" ")
    stop = " ".join(words[2:4])
    stopped = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=[stop])
    assert stopped.choices[0].text == full[: full.index(stop)] and stopped.choices[0].finish_reason == "stop"
    through_stop = next(n for n in range(1, 13) if stop in " ".join(words[:n]))  # a word per token
    assert stopped.usage.completion_tokens == through_stop  # not what the engine made before it was cancelled
    streamed = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(p.choices[0].text for p in streamed if p.choices) == stopped.choices[0].text
    assert streamed[-1].usage.completion_tokens == through_stop


@contextlib.contextmanager
def stepped_server(folder):
    """(engine, base URL): uvicorn serves the app on a free loopback port in a thread, over an engine the test
    steps itself (its thread not started), so a client surely leaves while its request runs."""
    import threading

    import uvicorn

    tokenizer, model = load_tokenizer(folder), load_pretrained(folder)
    engine = GenerationEngine(model, EngineConfig(rows=2, context=128, chunk_steps=2), eos_ids=())
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(OpenAIServer(engine, tokenizer, MODEL).app(), host="127.0.0.1",
                                           port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        for _ in range(200):
            if server.started:
                break
            time.sleep(0.05)
        yield engine, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def step_until_cancelled(engine: GenerationEngine) -> None:
    """Steps the engine (40 more chunks would end the request at its budget) until the server has cancelled it."""
    for _ in range(40):
        engine.run_once()
        if engine.metrics.finished:
            break
        time.sleep(0.1)
    assert engine.metrics.finished == {"cancelled": 1} and engine.rows_busy == 0
    assert engine.metrics.generated_tokens < 100


def test_a_client_that_leaves_mid_stream_frees_its_row(tiny_with_tokenizer):
    with stepped_server(tiny_with_tokenizer) as (engine, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        stream = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=100, temperature=0,
                                           stream=True)
        assert engine.queue_depth == 1
        engine.run_once()  # admitted: the first token and one chunk of 2
        assert engine.rows_busy == 1 and next(iter(stream)).choices[0].text
        stream.close()
        step_until_cancelled(engine)


def test_a_client_that_leaves_before_its_whole_answer_frees_its_row(tiny_with_tokenizer):
    """Without `stream`: the client gives up waiting (its read times out); the handler, polling, cancels."""
    with stepped_server(tiny_with_tokenizer) as (engine, base):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=1.5)
        with pytest.raises(openai.APITimeoutError):
            with ThreadPoolExecutor(1) as pool:
                waiting = pool.submit(client.completions.create, model=MODEL, prompt=[5, 6, 7], max_tokens=100,
                                      temperature=0)
                for _ in range(100):
                    if engine.queue_depth:
                        break
                    time.sleep(0.02)
                engine.run_once()  # admitted; the answer is not whole yet
                assert engine.rows_busy == 1
                waiting.result()
        step_until_cancelled(engine)


BAD = [  # (path, body, status, param, words of the message)
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "temperature": -1}, 400, "temperature", "[0.0, 2.0]"),
    ("/v1/completions", '{"model": "model", "prompt": "w1", "temperature": NaN}', 400, "temperature", "finite"),
    ("/v1/completions", {"model": "gpt-4", "prompt": "w1"}, 404, "model", "does not exist"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": CONTEXT}, 400, "max_tokens", "context"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": "5"}, 400, "max_tokens", "integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    ("/v1/completions", {"model": MODEL, "prompt": ""}, 400, "prompt", "empty"),
    ("/v1/completions", {"model": MODEL, "prompt": ["w1", "w2"]}, 400, "prompt", "one prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, 9999]}, 400, "prompt", "token ids"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "n": 2}, 400, "n", "one choice"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "logprobs": 3}, 400, "logprobs", "not supported"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "stream": "yes"}, 400, "stream", "true or false"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "messages", "non-empty"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "bot", "content": "w1"}]}, 400, "messages",
     "role"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages",
     "string"),
    ("/v1/chat/completions", "{not json", 400, None, "not valid JSON"),
    ("/v1/chat/completions", "[1, 2]", 400, None, "JSON object"),
    ("/v1/chat/completions", "x" * (2 << 20), 413, None, "bytes"),
    ("/v1/chat/completions", "[" * 100_000, 400, None, "not valid JSON"),  # nested too deep for the parser
    ("/v1/completions", '{"prompt": "w1", "max_tokens": 1' + "0" * 5000 + "}", 400, None, "not valid JSON"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "top_k": 2**40}, 400, "top_k", "vocabulary size"),
    ("/v1/completions", {"model": MODEL, "prompt": "w1", "stop_token_ids": [-1]}, 400, "stop_token_ids", "[0, 128)"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "w1 " * CONTEXT}]}, 400,
     "messages", "shorten the prompt"),
    ("/v1/completions", '{"model": "model", "prompt": "w1 \\ud800"}', 400, "prompt", "lone surrogate (\\ud800)"),
    ("/v1/chat/completions", '{"model": "model", "messages": [{"role": "user", "content": "\\udfff w1"}]}', 400,
     "messages", "messages[0].content is not valid Unicode"),
    ("/v1/completions", '{"model": "model", "prompt": "w1", "stop": ["w2", "\\ud83d"]}', 400, "stop", "surrogate"),
]


@pytest.mark.parametrize("path,body,status,param,words", BAD, ids=[f"{b[0]}-{i}" for i, b in enumerate(BAD)])
def test_bad_requests_get_openai_error_json(server, path, body, status, param, words):
    content = body if isinstance(body, str) else json.dumps(body)
    response = httpx.post(server[0] + path, content=content, headers={"content-type": "application/json"},
                          timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param
    assert words in error["message"]


def test_the_server_serves_on_after_bad_requests(server, client):
    assert httpx.get(server[0] + "/nowhere", timeout=10).json()["error"]["type"] == "not_found_error"
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="w1", temperature=-0.5)
    assert client.completions.create(model=MODEL, prompt="w1", max_tokens=3, temperature=0).usage.completion_tokens
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert httpx.get(server[0] + "/health", timeout=10).json()["status"] == "ok"


def test_full_queue_answers_429_and_a_closed_engine_503(tiny_with_tokenizer):
    """In process, with an engine whose thread never starts (so queued requests stay queued)."""
    tokenizer = load_tokenizer(tiny_with_tokenizer)
    engine = GenerationEngine(load_pretrained(tiny_with_tokenizer), EngineConfig(rows=1, context=64, max_queue=1),
                              eos_ids=(2,))
    app = TestClient(OpenAIServer(engine, tokenizer, MODEL).app())
    engine.submit([5, 6], RequestParams())
    busy = app.post("/v1/completions", json={"model": MODEL, "prompt": "w1"})
    assert busy.status_code == 429 and busy.json()["error"]["code"] == "queue_full"
    engine.close(drain=False)
    closed = app.post("/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "w1"}]})
    assert closed.status_code == 503 and "shutting down" in closed.json()["error"]["message"]
    assert 'medusa_requests_rejected_total 2' in app.get("/metrics").text


def test_a_server_with_heads_answers_greedily_as_generate(tiny_with_tokenizer):
    """In process: an engine with random Medusa heads and a tree behind the app; greedy answers, whole and
    streamed, equal `generate`'s; a sampled request with a seed is answered, the same twice."""
    from test_generation_engine import random_heads

    tokenizer, model = load_tokenizer(tiny_with_tokenizer), load_pretrained(tiny_with_tokenizer)
    heads = random_heads(model, "medusa")
    tree = load_tree("mc_sim_7b_8", num_heads=3, max_top_k=heads.config.head_vocab_size)
    eos = eos_token_ids(tiny_with_tokenizer, tokenizer)
    engine = GenerationEngine(model, EngineConfig(rows=2, context=64, chunk_steps=2), eos_ids=eos, heads=heads,
                              tree=tree)
    engine.start()
    app = TestClient(OpenAIServer(engine, tokenizer, MODEL).app())
    try:
        for prompt in ("w3 w4 w5", "w9"):
            want = generate(model, [tokenizer(prompt)["input_ids"]], max_new_tokens=10, eos_ids=eos)[0].token_ids
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 10, "temperature": 0}
            answer = app.post("/v1/completions", json=body).json()
            assert answer["choices"][0]["text"] == decode_tokens(tokenizer, want)
            assert answer["usage"]["completion_tokens"] == len(want)
            with app.stream("POST", "/v1/completions", json={**body, "stream": True}) as stream:
                chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                          if line.startswith("data: {")]
            assert "".join(c["choices"][0]["text"] for c in chunks) == answer["choices"][0]["text"]
        sampled = {"model": MODEL, "prompt": "w1", "max_tokens": 8, "temperature": 0.8, "seed": 4}
        answers = [app.post("/v1/completions", json=sampled).json() for _ in range(2)]
        assert answers[0]["choices"][0]["text"] == answers[1]["choices"][0]["text"]  # the seed fixes the draw
        assert answers[0]["usage"]["completion_tokens"] >= 1
    finally:
        engine.close()


def test_bad_flags_are_one_error_line_before_loading(tiny_with_tokenizer, capsys):
    serve = load_script("serve")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for args, words in ((["--port", "0"], "--port 0: must be in [1, 65535]"),
                            (["--batch-size", "0"], "--batch-size 0: must be >= 1"),
                            (["--port", str(port)], f"--port {port}: cannot listen"),
                            (["--host", "no.such.host.invalid"], "--host no.such.host.invalid: cannot be resolved")):
            with pytest.raises(SystemExit) as exit_:
                serve.main(["--model", str(tiny_with_tokenizer), *args])
            err = capsys.readouterr().err
            assert exit_.value.code == 2 and err.count("\n") == 1 and err.startswith("error: ") and words in err
    code = serve.main(["--model", str(tiny_with_tokenizer), "--port", str(free_port()), "--context", "100000"])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith("error: --context 100000: the model has 512 positions")


def test_attention_flag_reaches_the_model_load(tiny_with_tokenizer, reference, monkeypatch):
    """--attention xla: the model is loaded with that attention and the engine's greedy tokens equal `generate`'s
    (whose model runs the default chunked attention)."""
    serve = load_script("serve")
    loads = []

    def recording_load(*args, **kwargs):
        loads.append(kwargs["layers"].attention)
        return load_pretrained(*args, **kwargs)

    monkeypatch.setattr(serve, "load_pretrained", recording_load)
    a = serve.parse_args(["--model", str(tiny_with_tokenizer), "--port", str(free_port()), "--batch-size", "2",
                          "--context", "64", "--attention", "xla"])
    engine, tokenizer, _ = serve.build_engine(a)
    assert loads == ["xla"]
    _, greedy = reference
    prompts = [[5, 6, 7], [9, 10]]
    assert engine.generate_all(prompts, RequestParams(max_tokens=8)) == [greedy(p, 8) for p in prompts]


def test_benchmark_load_levels_and_soak(server, tmp_path, capsys):
    """scripts/benchmark_serve.py against this server: every request of the load levels answered; a short soak of
    mixed streamed, whole, cancelled and bad requests: each good one answered exactly once, each bad one a 4xx."""
    bench = load_script("benchmark_serve")
    out = tmp_path / "load.json"
    assert bench.main(["--url", server[0], "--concurrency", "1,3", "--requests-per-client", "2", "--max-tokens", "6",
                       "--out", str(out)]) == 0
    levels = json.loads(out.read_text())["levels"]
    assert [(l["clients"], l["requests"], l["failed"]) for l in levels] == [(1, 2, 0), (3, 6, 0)]
    assert str(tmp_path) not in json.loads(out.read_text())["command"]  # no path of this machine in a report
    assert all(l["tokens"] > 0 and l["ttft_s"]["p50"] > 0 for l in levels)
    assert bench.main(["--url", server[0], "--concurrency", "4", "--max-tokens", "8", "--soak-seconds", "4",
                       "--out", str(out)]) == 0
    soak = json.loads(out.read_text())["soak"]
    assert soak["good"] > 0 and soak["answered_once"] == soak["good"] and soak["bad_4xx"] == soak["bad"]
    assert soak["server_errors"] == 0 and soak["other_failures"] == 0 and soak["rows_busy_after"] == 0
    assert len(soak["resident_mib_each_minute"]) == 1 and soak["resident_mib_each_minute"][0] > 0  # one, at 4 s
    with pytest.raises(SystemExit):
        bench.main(["--url", "http://example.com:80", "--out", str(out)])
    assert "127.0.0.1" in capsys.readouterr().err


def test_sigterm_drains_running_requests_and_exits(server, client):
    """Last: SIGTERM while a stream runs; the stream still gets all its tokens, then the process ends (by the
    signal, re-raised by uvicorn once it has drained)."""
    base, process = server
    stream = client.completions.create(model=MODEL, prompt="w2", max_tokens=CONTEXT - 2, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    pieces = iter(stream)
    next(pieces)
    process.send_signal(signal.SIGTERM)
    rest = list(pieces)
    usage = rest[-1].usage
    assert rest[-2].choices[0].finish_reason in ("stop", "length") and usage.completion_tokens >= 1
    assert process.wait(60) in (0, -signal.SIGTERM)
    assert "drained" in process.stderr.read()
