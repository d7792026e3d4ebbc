"""``bertopt serve --http-port``: real server processes on 127.0.0.1, the official ``openai`` client and httpx,
answers compared with the in-process Predictor."""

from __future__ import annotations

import json
import os
import signal
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx  # the dev extra, which make test installs: a missing one must fail here, not skip
import numpy as np
import pytest
from served_checks import metric_value

from bertopt.harness import descendants

pytestmark = [pytest.mark.slow, pytest.mark.server]
KEY = "test-secret-key"
TEXTS = ["hello world", "the quick brown fox jumps over the lazy dog", "a", "serving models over http is fun",
         "hello world"]


def l2(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.fixture(scope="module")
def emb_server(http_server):
    return http_server


def auth(key: str = KEY) -> dict:
    return {"Authorization": f"Bearer {key}"}


def post(server, route: str, body, key: str = KEY, **kw):
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(server.url + route, content=content, headers=auth(key), timeout=60, **kw)


def test_openai_client_embeddings_equal_the_in_process_runtime(emb_server, tiny_predictor):
    from openai import AuthenticationError, OpenAI

    client = OpenAI(base_url=emb_server.url + "/v1", api_key=KEY, max_retries=0)
    expected = tiny_predictor.encode(TEXTS)
    res = client.embeddings.create(input=TEXTS, model="tiny")  # the client asks for base64 and decodes it
    got = np.array([d.embedding for d in res.data], dtype=np.float32)
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [d.index for d in res.data] == list(range(len(TEXTS)))
    lengths = [len(e.ids) for e in tiny_predictor.tokenize(TEXTS)]
    assert res.usage.prompt_tokens == sum(lengths) and res.model == "tiny"

    floats = client.embeddings.create(input="hello world", model="tiny", encoding_format="float")
    np.testing.assert_allclose(floats.data[0].embedding, expected[0], atol=1e-5)
    short = client.embeddings.create(input=TEXTS[:2], model="tiny", dimensions=8)
    np.testing.assert_allclose(np.array([d.embedding for d in short.data]), l2(expected[:2, :8]), atol=1e-5)

    ids = [e.ids for e in tiny_predictor.tokenize(TEXTS[:2])]  # token-id input: the same vectors
    by_ids = client.embeddings.create(input=ids, model="tiny", encoding_format="float")
    np.testing.assert_allclose(np.array([d.embedding for d in by_ids.data]), expected[:2], atol=1e-5)
    assert [m.id for m in client.models.list().data] == [os.path.basename(emb_server_artifact(emb_server))]

    with pytest.raises(AuthenticationError, match="API key"):
        OpenAI(base_url=emb_server.url + "/v1", api_key="wrong", max_retries=0).embeddings.create(
            input="x", model="tiny")


def emb_server_artifact(server) -> str:
    return httpx.get(server.url + "/info", headers=auth(), timeout=30).json()["artifact"]


def test_tei_routes_answer_like_the_in_process_runtime(emb_server, tiny_predictor, tiny_onnx):
    expected = tiny_predictor.encode(TEXTS)
    r = post(emb_server, "/embed", {"inputs": TEXTS})
    assert r.status_code == 200
    np.testing.assert_allclose(np.array(r.json()), l2(expected), atol=1e-5)
    raw = post(emb_server, "/embed", {"inputs": "hello world", "normalize": False}).json()
    np.testing.assert_allclose(raw, expected[:1], atol=1e-5)

    tokens = post(emb_server, "/tokenize", {"inputs": ["hello world"]}).json()[0]
    assert [t["id"] for t in tokens] == tiny_predictor.tokenize(["hello world"])[0].ids
    assert [(t["text"], t["start"], t["stop"]) for t in tokens if not t["special"]] == [("hello", 0, 5),
                                                                                        ("world", 6, 11)]
    health = httpx.get(emb_server.url + "/health", timeout=30)  # no key needed: it is the readiness probe
    assert health.status_code == 200 and health.json()["workers_ready"] == 2
    info = httpx.get(emb_server.url + "/info", headers=auth(), timeout=30).json()
    assert (info["model_sha"], info["task"], info["max_input_length"]) == (tiny_onnx.digest, "embedding",
                                                                          tiny_predictor.max_seq_len)
    assert info["runtime"]["backend"] == "onnxruntime"
    # the same fleet serves ZeroMQ clients
    with emb_server.client() as zmq_client:
        np.testing.assert_allclose(zmq_client.encode(TEXTS), expected, atol=1e-5)
    # a route for another task says which one fits
    wrong = post(emb_server, "/predict", {"inputs": "hello"})
    assert wrong.status_code == 400 and "needs a classification model" in wrong.json()["error"]
    assert "/embed" in wrong.json()["error"]
    metrics = httpx.get(emb_server.url + "/metrics", headers=auth(), timeout=30).text
    assert 'bertopt_http_requests_total{route="/embed",status="200"}' in metrics
    assert "bertopt_batch_tokens_bucket" in metrics and "bertopt_queue_seconds_count" in metrics


@pytest.mark.parametrize("route, body, status, message", [
    ("/embed", b'{"inputs": ["unterminated', 400, "not valid JSON"),
    ("/embed", {"inputs": 42}, 422, "must be a string or a list of strings"),
    ("/embed", {"inputs": ["ok", 3.5]}, 422, "'inputs[1]' is a float"),
    ("/embed", {"inputs": []}, 422, "is empty"),
    ("/embed", {"inputs": ""}, 422, "empty string"),
    ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "'normalize' must be true or false"),
    ("/embed", {"inputs": ["x"] * 10_000}, 413, "limit of 2048 (--max-client-batch-size)"),
    ("/embed", {"inputs": [" ".join(["hello"] * 200)]}, 413, "more than this model's limit of"),
    ("/embed", {"inputs": [[2, 10_000, 3]]}, 422, "outside this model's vocabulary"),
    ("/embed", {"inputs": ["x" * 150_000]}, 413, "--max-request-bytes"),
    ("/v1/embeddings", {"input": {"a": 1}, "model": "m"}, 400, "'input' must be a string"),
    ("/v1/embeddings", {"model": "m"}, 400, "missing 'input'"),
    ("/v1/embeddings", {"input": [], "model": "m"}, 400, "'input' is empty"),
    ("/v1/embeddings", {"input": ["x"] * 3000, "model": "m"}, 400, "limit of 2048"),
    ("/v1/embeddings", {"input": "x", "model": "m", "encoding_format": "hex"}, 400, "'encoding_format'"),
    ("/v1/embeddings", {"input": "x", "model": "m", "dimensions": 9999}, 400, "'dimensions' must be"),
    # OpenAI's routes answer every invalid request 400 (these two said 422, TEI's code)
    ("/v1/embeddings", {"input": "x", "model": "m", "truncate": "yes"}, 400, "'truncate' must be true or false"),
    ("/v1/embeddings", {"input": "x", "model": "m", "long_inputs": ["x"]}, 400, "'long_inputs' must be one of"),
    ("/embed", {"inputs": "x", "long_inputs": "cut"}, 422, "'long_inputs' must be one of"),
    ("/v1/embeddings", b"[1, 2", 400, "not valid JSON"),
])
def test_bad_requests_get_a_clear_4xx_and_the_server_stays_up(emb_server, route, body, status, message):
    r = post(emb_server, route, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    text = err["message"] if route.startswith("/v1") else err
    assert message in text and "Traceback" not in r.text
    if route.startswith("/v1"):
        assert err["type"] == "invalid_request_error"
    assert post(emb_server, "/embed", {"inputs": "still up"}).status_code == 200


def test_one_list_of_token_ids_is_one_input_however_long(emb_server):
    """A flat list of ids is one input (OpenAI's form): it was counted as that many inputs first, so 3000 ids were
    refused as "3000 inputs, more than this server's limit of 2048"."""
    ids = [2] + [7] * 2998 + [3]
    flat = post(emb_server, "/embed", {"inputs": ids, "truncate": True})
    nested = post(emb_server, "/embed", {"inputs": [ids], "truncate": True})
    assert flat.status_code == 200 and nested.status_code == 200, flat.text
    assert len(flat.json()) == 1 and flat.json() == nested.json()


def test_truncate_true_cuts_an_over_long_input_and_a_wrong_key_is_refused(emb_server, tiny_predictor):
    long_text = " ".join(["hello"] * 200)
    r = post(emb_server, "/embed", {"inputs": long_text, "truncate": True, "normalize": False})
    assert r.status_code == 200
    np.testing.assert_allclose(r.json(), tiny_predictor.encode([long_text]), atol=1e-5)  # the runtime truncates
    for headers in ({}, auth("wrong"), {"Authorization": KEY}):
        bad = httpx.post(emb_server.url + "/embed", json={"inputs": "x"}, headers=headers, timeout=30)
        assert bad.status_code == 401 and "API key" in bad.json()["error"]


def test_predict_on_a_classifier_http_only(task_artifact, start_server):
    from bertopt.runtime import Predictor

    _, cls = task_artifact("classification")
    server = start_server(cls.path, "--no-zmq", http=True, num_worker=1)
    pred = Predictor(cls, threads=1)
    expected = pred.predict(TEXTS[:3])
    batch = httpx.post(server.url + "/predict", json={"inputs": TEXTS[:3]}, timeout=60).json()
    for row, want in zip(batch, expected):
        assert row[0]["label"] == want["label"] and abs(row[0]["score"] - want["score"]) < 1e-5
        assert {d["label"]: pytest.approx(d["score"], abs=1e-5) for d in row} == want["scores"]
        assert [d["score"] for d in row] == sorted((d["score"] for d in row), reverse=True)
    logits = pred.encode(TEXTS[:1])
    single = httpx.post(server.url + "/predict", json={"inputs": TEXTS[0], "raw_scores": True}).json()
    np.testing.assert_allclose(sorted(d["score"] for d in single), np.sort(logits[0]), atol=1e-5)
    pair = httpx.post(server.url + "/predict", json={"inputs": ["hello world", "the cat"]})  # pair_input false
    assert pair.status_code == 422 and "takes a single text" in pair.json()["error"]
    for route, body in (("/embed", {"inputs": "x"}), ("/v1/embeddings", {"input": "x", "model": "m"}),
                        ("/rerank", {"query": "q", "texts": ["a"]})):
        r = httpx.post(server.url + route, json=body, timeout=30)
        assert r.status_code == 400 and "this server serves a classification model" in r.text
        assert "use /predict" in r.text
    import socket

    with pytest.raises(ConnectionRefusedError):  # --no-zmq: nothing listens on the ZeroMQ port
        socket.create_connection(("127.0.0.1", server.port), timeout=5).close()


def test_legacy_classifier_manifest_is_served_on_predict(tmp_path, start_server):
    from bertopt.registry import run_stage
    from bertopt.runtime import Predictor
    from bertopt.tiny_models import build_tiny_hf_bert

    art = run_stage("export", build_tiny_hf_bert(tmp_path / "hf", classifier=True), {}, tmp_path / "cls")
    manifest = json.loads((art.path / "bertopt.json").read_text())  # as written before the task contract
    manifest["model"]["task"] = "classifier"
    manifest["model"]["pair_input"] = True  # a sentence-pair classifier (NLI-style): TEI's [text, text] input
    (art.path / "bertopt.json").write_text(json.dumps(manifest))
    server = start_server(art.path, "--no-zmq", http=True, num_worker=1)
    got = httpx.post(server.url + "/predict", json={"inputs": "hello world"}, timeout=60).json()
    want = Predictor(art, threads=1).predict(["hello world"])[0]
    assert got[0]["label"] == want["label"] and abs(got[0]["score"] - want["score"]) < 1e-5
    pair_logits = Predictor(art, threads=1).encode(["hello world"], pairs=["the cat"])  # TEI: 2 strings = a pair
    pair = httpx.post(server.url + "/predict", json={"inputs": ["hello world", "the cat"], "raw_scores": True})
    assert pair.status_code == 200, pair.text
    np.testing.assert_allclose(sorted(d["score"] for d in pair.json()), np.sort(pair_logits[0]), atol=1e-5)


def test_rerank_and_sparse_answer_like_the_predictor(task_artifact, start_server):
    from bertopt.runtime import Predictor

    passages = ["the cat sat", "hello world", "a dog", "quick brown fox"]
    _, rerank = task_artifact("rerank")
    server = start_server(rerank.path, "--no-zmq", http=True, num_worker=1)
    want = Predictor(rerank, threads=1).rerank("hello", passages)
    got = httpx.post(server.url + "/rerank", json={"query": "hello", "texts": passages, "return_text": True},
                     timeout=60).json()
    assert [d["index"] for d in got] == [d["index"] for d in want]
    np.testing.assert_allclose([d["score"] for d in got], [d["score"] for d in want], atol=1e-5)
    assert [d["text"] for d in got] == [passages[d["index"]] for d in got]
    wrong = httpx.post(server.url + "/predict", json={"inputs": "x"}, timeout=30)
    assert wrong.status_code == 400 and "use /rerank" in wrong.json()["error"]
    server.stop()

    _, sparse = task_artifact("sparse-embedding")
    server = start_server(sparse.path, "--no-zmq", http=True, num_worker=1)
    want = Predictor(sparse, threads=1).predict(passages)
    got = httpx.post(server.url + "/embed_sparse", json={"inputs": passages}, timeout=60).json()
    for g, w in zip(got, want):
        assert [d["index"] for d in g] == w["indices"]
        np.testing.assert_allclose([d["value"] for d in g], w["values"], atol=1e-5)


def test_worker_killed_under_http_load_every_request_answered_once(tiny_onnx, tiny_predictor, start_server):
    server = start_server(tiny_onnx.path, "--max-batch-tokens", "64", "--max-batch-size", "8", http=True)
    words = ["hello", "world", "the", "quick", "brown", "fox", "serving", "models"]
    requests = [[" ".join(words[(i + k) % 8] for k in range(1 + (i * 7 + j) % 12)) for j in range(1 + i % 40)]
                for i in range(120)]
    with server.client() as c:
        worker = c.status()["workers"][0]["pid"]
    results: dict[int, list] = {}
    killed = threading.Event()

    def call(i: int):
        if i == 30:
            os.kill(worker, signal.SIGKILL)
            killed.set()
        r = httpx.post(server.url + "/embed", json={"inputs": requests[i], "normalize": False}, timeout=120)
        return i, r.status_code, r.json()

    with ThreadPoolExecutor(8) as pool:
        for i, status, body in pool.map(call, range(len(requests))):
            assert status == 200, body
            results[i] = body
    assert killed.is_set() and len(results) == len(requests)
    for i, body in results.items():  # every answer is its own request's, in order
        np.testing.assert_allclose(np.array(body), tiny_predictor.encode(requests[i]), atol=1e-5)
    with server.client() as c:
        status = c.status()
    assert status["worker_restarts"] >= 1 and status["http_requests"] == len(requests)
    assert status["replies_sent"] == status["http_requests"]  # one reply each: duplicates were dropped


def test_overload_answers_429_and_no_admitted_request_times_out(tiny_onnx, tiny_predictor, start_server):
    server = start_server(tiny_onnx.path, "--max-concurrent-requests", "3", "--request-timeout", "120",
                          http=True, num_worker=1)
    texts = [" ".join(["hello world the quick brown fox"] * 6)] * 400

    def call(_):
        r = httpx.post(server.url + "/embed", json={"inputs": texts}, timeout=180)
        return r.status_code, r.headers.get("retry-after"), r.json()

    with ThreadPoolExecutor(24) as pool:
        outcomes = list(pool.map(call, range(48)))
    codes = [c for c, _, _ in outcomes]
    assert set(codes) == {200, 429}, codes
    assert all(ra == "1" and "--max-concurrent-requests" in body["error"]
               for c, ra, body in outcomes if c == 429)
    expected = l2(tiny_predictor.encode(texts[:1]))
    for c, _, body in outcomes:
        if c == 200:
            np.testing.assert_allclose(np.array(body), np.repeat(expected, len(texts), axis=0), atol=1e-5)


def test_sigterm_answers_admitted_http_requests_then_exits_0(tiny_onnx, start_server):
    # SIGTERM to the whole process group (systemd, `timeout`, container inits): workers and sink ignore it and
    # the server drains; no worker "dies" and is restarted mid-drain
    server = start_server(tiny_onnx.path, "--no-zmq", http=True, num_worker=1, new_session=True)
    texts = ["hello world the quick brown fox"] * 1500
    with ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(httpx.post, server.url + "/embed", json={"inputs": texts}, timeout=120)
                   for _ in range(4)]
        import time

        # every request admitted, some still running: on a busy machine the first may be answered before the
        # last is admitted, so "4 in flight at once" is not waited for
        deadline = time.monotonic() + 30
        while True:
            metrics = httpx.get(server.url + "/metrics").text
            in_flight = metric_value(metrics, "bertopt_http_requests_in_flight")
            answered = metric_value(metrics, "bertopt_http_requests_total", route="/embed", status="200")
            if in_flight >= 1 and in_flight + answered == 4:
                break
            assert answered < 4, "every request was answered before the SIGTERM: nothing left to drain"
            assert time.monotonic() < deadline, f"not all admitted: {in_flight} in flight, {answered} answered"
            time.sleep(0.02)
        server.children |= descendants(server.proc.pid)
        os.killpg(server.proc.pid, signal.SIGTERM)
        assert server.proc.wait(60) == 0
        assert [f.result().status_code for f in futures] == [200] * 4
    assert "stopped" in server.log() and "died" not in server.log()


def test_serve_http_options_refuse_clearly(cli, tiny_onnx):
    import socket

    from bertopt.harness import free_port

    code, _, err = cli("serve", str(tiny_onnx.path), "--no-zmq")
    assert code == 2 and "--no-zmq leaves nothing to serve; add --http-port PORT" in err
    code, _, err = cli("serve", str(tiny_onnx.path), "--http-port", "70000")
    assert code == 2 and "serve: 'http_port' must be between 1 and 65535, got 70000" in err
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = cli("serve", str(tiny_onnx.path), "--no-zmq", "--http-port", str(port),
                           "--port-out", str(free_port()))
    assert code == 2 and f"cannot bind HTTP 127.0.0.1:{port}" in err and "Traceback" not in err


def test_token_classification_entities_over_http_equal_the_predictor(task_artifact, start_server):
    from bertopt.runtime import Predictor

    _, ner = task_artifact("token-classification")
    server = start_server(ner.path, "--no-zmq", http=True, num_worker=1)
    pred = Predictor(ner, threads=1)
    texts = ["hello world the quick brown fox", "serving models over http"]
    for aggregation in ("simple", "none", "first"):
        want = pred.predict(texts, aggregation=aggregation)
        got = httpx.post(server.url + "/predict", json={"inputs": texts, "aggregation_strategy": aggregation},
                         timeout=60).json()
        assert len(got) == len(want) and any(want), "the tiny model finds no entity: the check would be empty"
        for g, w in zip(got, want):
            assert [{k: v for k, v in e.items() if k != "score"} for e in g] == \
                   [{k: v for k, v in e.items() if k != "score"} for e in w]
            np.testing.assert_allclose([e["score"] for e in g], [e["score"] for e in w], atol=1e-5)
    single = httpx.post(server.url + "/predict", json={"inputs": texts[0]}, timeout=60).json()
    assert [e["word"] for e in single] == [e["word"] for e in pred.predict(texts[:1])[0]]
    bad = httpx.post(server.url + "/predict", json={"inputs": "x", "aggregation_strategy": "best"}, timeout=30)
    assert bad.status_code == 422 and "'aggregation_strategy' must be one of" in bad.json()["error"]


def test_bulk_lane_threads_run_niced_so_priority_work_gets_the_cores(http_server, cli, tiny_onnx):
    with http_server.client() as c:
        pids = [w["pid"] for w in c.status()["workers"]]
    for pid in pids:
        nice = [int(open(f"/proc/{pid}/task/{tid}/stat").read().rsplit(")", 1)[1].split()[16])
                for tid in os.listdir(f"/proc/{pid}/task")]
        assert nice.count(10) == 1 and nice.count(0) == len(nice) - 1, nice  # the bulk lane thread only
    code, _, err = cli("serve", str(tiny_onnx.path), "--bulk-nice", "20")
    assert code == 2 and "serve: 'bulk_nice' must be between 0 and 19, got 20" in err


def test_request_timeout_answers_504_and_the_late_reply_is_dropped(tiny_onnx, start_server):
    server = start_server(tiny_onnx.path, "--no-zmq", "--request-timeout", "0.001", http=True, num_worker=1)
    # 2000 texts: the fleet cannot answer before the event loop runs the 1 ms timer, even on a loaded machine
    r = httpx.post(server.url + "/embed", json={"inputs": ["hello world"] * 2000}, timeout=60)
    assert r.status_code == 504 and "--request-timeout" in r.json()["error"]
    # the OpenAI route's timeout body, on a request just as large (one short text can beat a 1 ms timer)
    o = httpx.post(server.url + "/v1/embeddings", json={"input": ["hello world"] * 2000, "model": "m"}, timeout=60)
    assert o.status_code == 504 and o.json()["error"]["type"] == "timeout_error"
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200  # still up
