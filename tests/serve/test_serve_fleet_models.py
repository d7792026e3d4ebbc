"""Several artifacts on one ``bertopt serve`` fleet: a tiny embedder, reranker and classifier in one real server
process on 127.0.0.1, reached by the ``openai`` client, httpx, bertopt's Client (``model=``) and the unchanged
bert-serving-client; every answer equals the in-process Predictor on that artifact within the artifact's recorded
bound (``Artifact.served_deviation_bound``), and a flood on one model leaves the others answering."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import numpy as np
import pytest
from served_checks import encode_flood, served_deviation
from task_models import TASK_TEXTS

from bertopt.artifact import Artifact
from bertopt.runtime import Predictor

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(900)]
QUERY = "the cat sat on a mat"
NAMES = ("embed", "rerank", "cls")


def _validated(art, folder):
    """A copy of ``art`` validated (so its manifest records the batch deviation served outputs are held to)."""
    shutil.copytree(art.path, folder)
    proc = subprocess.run([sys.executable, "-m", "bertopt.cli", "validate", str(folder), "--no-latency",
                           "--max-texts", "96", "--report-dir", str(folder.parent / f"{folder.name}-report")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return Artifact.load(folder)


@pytest.fixture(scope="module")
def arts(tiny_onnx, task_artifact, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet-arts")
    sources = {"embed": tiny_onnx, "rerank": task_artifact("rerank")[1], "cls": task_artifact("classification")[1]}
    return {name: _validated(art, root / name) for name, art in sources.items()}


@pytest.fixture(scope="module")
def predictors(arts):
    return {name: Predictor(art, threads=1) for name, art in arts.items()}


@pytest.fixture(scope="module")
def fleet(arts, server_process, tmp_path_factory):
    """embed (first, the default), rerank and cls on one fleet, one worker each, ZeroMQ and HTTP."""
    server = server_process(f"embed={arts['embed'].path}", tmp_path_factory.mktemp("fleet-server"),
                            f"rerank={arts['rerank'].path}", f"cls={arts['cls'].path}", num_worker=1, http=True)
    try:
        yield server
    finally:
        server.stop()


def _within(got, want, art):
    bound = art.served_deviation_bound()
    dev = served_deviation(got, want)
    assert dev <= bound, (dev, bound)


def _rerank_vector(ranked: list[dict], n: int) -> np.ndarray:
    out = np.zeros(n)
    for r in ranked:
        out[r["index"]] = r["score"]
    return out


def test_openai_client_and_httpx_reach_each_model_with_in_process_values(fleet, arts, predictors):
    from openai import OpenAI

    client = OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(input=TASK_TEXTS, model="embed", encoding_format="float")
    assert res.model == "embed"
    _within(np.array([d.embedding for d in res.data], dtype=np.float32), predictors["embed"].encode(TASK_TEXTS),
            arts["embed"])

    # TEI routes: the route's task picks the model (the first of that task) unless "model" names one
    for body in ({"inputs": TASK_TEXTS, "normalize": False}, {"inputs": TASK_TEXTS, "normalize": False,
                                                                "model": "embed"}):
        got = httpx.post(fleet.url + "/embed", json=body, timeout=60)
        assert got.status_code == 200, got.text
        _within(np.array(got.json(), dtype=np.float32), predictors["embed"].encode(TASK_TEXTS), arts["embed"])

    rerank = predictors["rerank"]
    want = rerank.run([QUERY] * len(TASK_TEXTS), pairs=TASK_TEXTS, outputs=[rerank.primary_output])
    want = want[rerank.primary_output][:, 0]
    for body in ({"query": QUERY, "texts": TASK_TEXTS, "raw_scores": True},
                 {"query": QUERY, "texts": TASK_TEXTS, "raw_scores": True, "model": "rerank"}):
        got = httpx.post(fleet.url + "/rerank", json=body, timeout=60)
        assert got.status_code == 200, got.text
        scores = _rerank_vector(got.json(), len(TASK_TEXTS))
        _within(scores[None], want[None], arts["rerank"])
        np.testing.assert_allclose(scores, want, atol=1e-5)
        assert [r["index"] for r in got.json()] == [r["index"] for r in rerank.rerank(QUERY, TASK_TEXTS)]

    cls = predictors["cls"]
    logits = cls.run(TASK_TEXTS, outputs=[cls.primary_output])[cls.primary_output]
    from bertopt.runtime.tasks import label_names

    names = label_names(arts["cls"].model_info, logits.shape[1])
    got = httpx.post(fleet.url + "/predict", json={"inputs": TASK_TEXTS, "raw_scores": True}, timeout=60)
    assert got.status_code == 200, got.text
    served = np.array([[{d["label"]: d["score"] for d in row}[n] for n in names] for row in got.json()])
    _within(served, logits, arts["cls"])
    top = httpx.post(fleet.url + "/predict", json={"inputs": TASK_TEXTS[0], "model": "cls"}, timeout=60).json()
    assert top[0]["label"] == cls.predict(TASK_TEXTS[:1])[0]["label"]


def test_models_and_info_list_every_model_with_its_digest_and_task(fleet, arts):
    from openai import OpenAI

    listed = OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0).models.list().data
    assert [m.id for m in listed] == list(NAMES)
    raw = httpx.get(fleet.url + "/v1/models", timeout=30).json()["data"]
    assert [(m["id"], m["task"], m["digest"]) for m in raw] == [
        (n, t, arts[n].digest) for n, t in zip(NAMES, ("embedding", "rerank", "classification"))]
    info = httpx.get(fleet.url + "/info", timeout=30).json()
    assert info["model_id"] == "embed" and info["digest"] == arts["embed"].digest  # the first model, as before
    from bertopt.runtime.backends import default_threads

    split = max(1, default_threads() // len(NAMES))  # the cores split over every worker of the fleet
    assert [(m["model_id"], m["task"], m["digest"], m["runtime"]["threads"]) for m in info["models"]] == [
        (n, m["task"], arts[n].digest, split) for n, m in zip(NAMES, raw)]


def test_unknown_model_is_404_and_a_model_of_another_task_is_400_naming_the_right_ones(fleet):
    from openai import NotFoundError, OpenAI

    client = OpenAI(base_url=fleet.url + "/v1", api_key="unused", max_retries=0)
    with pytest.raises(NotFoundError, match="the model 'gpt-4' does not exist on this server"):
        client.embeddings.create(input="hello", model="gpt-4")
    got = httpx.post(fleet.url + "/v1/embeddings", json={"input": "hello", "model": "gpt-4"}, timeout=30)
    assert got.status_code == 404
    error = got.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "model", "model_not_found")
    assert "embed (embedding), rerank (rerank), cls (classification)" in error["message"]
    tei = httpx.post(fleet.url + "/rerank", json={"query": "q", "texts": ["a"], "model": "nope"}, timeout=30)
    assert tei.status_code == 404 and tei.json()["error_type"] == "NotFound"
    assert "the model 'nope' does not exist" in tei.json()["error"]

    wrong = httpx.post(fleet.url + "/v1/embeddings", json={"input": "hello", "model": "rerank"}, timeout=30)
    assert wrong.status_code == 400 and wrong.json()["error"]["code"] == "wrong_task"
    assert wrong.json()["error"]["message"] == (
        "/v1/embeddings needs an embedding model, but 'rerank' is a rerank model (use /rerank for it); models "
        "that serve it here: embed")
    wrong = httpx.post(fleet.url + "/rerank", json={"query": "q", "texts": ["a"], "model": "cls"}, timeout=30)
    assert wrong.status_code == 400 and "models that serve it here: rerank" in wrong.json()["error"]
    none = httpx.post(fleet.url + "/embed_sparse", json={"inputs": "hello"}, timeout=30)
    assert none.status_code == 400 and none.json()["error"] == (
        "/embed_sparse needs a sparse-embedding model, but none of this server's models is one (models: embed "
        "(embedding), rerank (rerank), cls (classification))")


def test_zeromq_clients_address_a_model_and_bert_serving_client_gets_the_first(fleet, arts, predictors, cli):
    from bert_serving.client import BertClient

    from bertopt.client import ServerError

    with fleet.client() as default:
        _within(default.encode(TASK_TEXTS), predictors["embed"].encode(TASK_TEXTS), arts["embed"])
        status = default.status()
        assert [(m["name"], m["digest"]) for m in status["models"]] == [(n, arts[n].digest) for n in NAMES]
        assert sorted(w["model"] for w in status["workers"]) == sorted(NAMES)
    with fleet.client(model="rerank") as client:
        got = client.predict([QUERY] * len(TASK_TEXTS), TASK_TEXTS)
        want = predictors["rerank"].predict([QUERY] * len(TASK_TEXTS), TASK_TEXTS)
        np.testing.assert_allclose(got, want, atol=1e-6)
        with pytest.raises(ServerError, match="model 'rerank' is a rerank model, which has no sentence embeddings.*"
                                              r"\(embedding models here: embed\)"):
            client.encode(["the cat"])
    with fleet.client(model="cls") as client:
        assert [r["label"] for r in client.predict(TASK_TEXTS)] == [
            r["label"] for r in predictors["cls"].predict(TASK_TEXTS)]
    with fleet.client(model="nope") as client:
        with pytest.raises(ServerError, match="unknown model 'nope'; this server serves 'embed', 'rerank', 'cls'"):
            client.encode(["the cat"])
    with BertClient(ip="127.0.0.1", port=fleet.port, port_out=fleet.port_out, timeout=60000) as bc:
        _within(bc.encode(TASK_TEXTS), predictors["embed"].encode(TASK_TEXTS), arts["embed"])
    where = ("--port", fleet.port, "--port-out", fleet.port_out)
    code, out, err = cli("client", "predict", QUERY, "--pair", TASK_TEXTS[0], "--model", "rerank", *where)
    assert code == 0, err
    assert json.loads(out)["result"] == pytest.approx(predictors["rerank"].predict([QUERY], TASK_TEXTS[:1])[0],
                                                      abs=1e-6)
    code, _, err = cli("client", "encode", "the cat", "--model", "cls", *where)
    assert code == 2 and "model 'cls' is a classification model, which has no sentence embeddings" in err


def test_a_flood_on_the_embedder_leaves_the_reranker_answering(fleet, arts, predictors):
    """Thousands of long texts queued for the embedder; the reranker (its own queues and worker) answers over HTTP
    and ZeroMQ while the flood is still queued, with the in-process values."""
    long = [" ".join(["the quick brown fox jumps over the lazy dog and keeps running"] * 10) + f" {i}"
            for i in range(256)]
    rerank = predictors["rerank"]
    want = rerank.run([QUERY] * 3, pairs=TASK_TEXTS[:3], outputs=[rerank.primary_output])[rerank.primary_output]
    with fleet.client(timeout=600) as flood, fleet.client(model="rerank") as probe:
        futures = [flood.encode_async(long) for _ in range(300)]
        for _ in range(5):
            got = httpx.post(fleet.url + "/rerank", json={"query": QUERY, "texts": TASK_TEXTS[:3], "raw_scores": True},
                             timeout=120)
            assert got.status_code == 200, got.text
            _within(_rerank_vector(got.json(), 3)[None], want[:, 0][None], arts["rerank"])
            np.testing.assert_allclose(probe.predict([QUERY] * 3, TASK_TEXTS[:3]),
                                       rerank.predict([QUERY] * 3, TASK_TEXTS[:3]), atol=1e-6)
        assert not all(f.done() for f in futures), "the flood ended before the probes: it measured nothing"
        last = futures[-1].result(600)
    _within(last[:8], predictors["embed"].encode(long[:8]), arts["embed"])
    metrics = httpx.get(fleet.url + "/metrics", timeout=30).text
    assert 'bertopt_model_requests_total{model="rerank",status="200"}' in metrics
    assert 'bertopt_queue_seconds_count{model="embed"}' in metrics
    assert 'bertopt_batch_texts_count{model="rerank"}' in metrics
    assert 'bertopt_queue_depth{model="cls"}' in metrics


def test_models_file_sets_each_models_workers_and_threads(arts, start_server, tmp_path):
    fleet_file = tmp_path / "fleet.yaml"
    shutil.copytree(arts["embed"].path, tmp_path / "models" / "e5")  # a relative path, read from the file's folder
    fleet_file.write_text(f"models:\n  e5:\n    artifact: models/e5\n    workers: 2\n    threads: 1\n"
                          f"  ranker: {arts['rerank'].path}\n")
    server = start_server(f"--models={fleet_file}", "--threads-per-worker", "2", num_worker=1)
    with server.client() as client:
        status = client.status()
        assert [(m["name"], m["num_worker"], m["threads_per_worker"]) for m in status["models"]] == [
            ("e5", 2, 1), ("ranker", 1, 2)]
        assert sorted((w["model"], w["threads"]) for w in status["workers"]) == [("e5", 1), ("e5", 1),
                                                                                 ("ranker", 2)]
        _within(client.encode(TASK_TEXTS), Predictor(arts["embed"]).encode(TASK_TEXTS), arts["embed"])
    assert "models e5 (embedding, 2 worker(s) x 1 thread(s)), ranker (rerank, 1 worker(s) x 2 thread(s))" in (
        server.log())


@pytest.mark.parametrize("args, fleet_yaml, message", [
    (["a={e}", "a={r}"], None, "two models are named 'a'; name them apart with NAME=PATH"),
    (["={e}"], None, "model name '' must be 1-128 letters"),
    (["--models", "{y}"], "models: [a, b]", "expected a 'models:' mapping of name -> artifact (or name -> "
     "{artifact, workers, threads})"),
    (["--models", "{y}"], "models:\n  a: {{artifact: {e}, gpus: 2}}", "model 'a': unknown key(s) gpus; use "
     "artifact, workers, threads"),
    (["--models", "{y}"], "models:\n  a: {{artifact: {e}, workers: 0}}", "'workers' must be a whole number from 1 "
     "to 256, got 0"),
    (["--models", "{y}"], "models: {{a: [", "not valid YAML"),
    (["--models", "{y}", "embed={e}"], "models:\n  embed: {r}", "two models are named 'embed'"),
    # billion laughs: 10^8 values from 1 KB (safe_load built them for minutes); refused before building
    (["--models", "{y}"], "a0: &a0 [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 8)) + "models: {{a: {{artifact: {e}, "
     "workers: *a7}}}}", "the YAML expands to more than 100000 values"),
    (["--models", "{f}"], None, "is not a regular file (a FIFO, socket or device), not a fleet file"),
    (["--models", "{t}"], None, "is a folder, not a fleet file"),
])
def test_fleet_definition_mistakes_are_one_line_and_exit_2(cli, arts, tmp_path, args, fleet_yaml, message):
    fill = {"e": arts["embed"].path, "r": arts["rerank"].path, "y": tmp_path / "fleet.yaml", "f": tmp_path / "fifo",
            "t": tmp_path}
    os.mkfifo(tmp_path / "fifo")  # a FIFO waits for a writer for ever when opened plainly
    if fleet_yaml is not None:
        (tmp_path / "fleet.yaml").write_text(fleet_yaml.format(**fill))
    code, out, err = cli("serve", *[a.format(**fill) for a in args])
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err


def test_status_json_lists_the_models_of_a_fleet(fleet, cli):
    code, out, err = cli("serve", "--status", "--json", "--port", fleet.port, "--port-out", fleet.port_out)
    assert code == 0, err
    assert [m["name"] for m in json.loads(out)["models"]] == list(NAMES)


def test_a_model_whose_workers_stop_fails_its_requests_and_the_other_model_serves_on(arts, predictors, start_server,
                                                                                       tmp_path):
    """The reranker's artifact is swapped on disk and its one worker killed: the restarts refuse it, the model is
    left without workers, its requests get an error (not a timeout), /health names it, the embedder serves on."""
    import os
    import signal
    import time

    from test_serve_worker_verify_restart import _swap_model

    from bertopt.client import ServerError

    folder = tmp_path / "rerank"
    shutil.copytree(arts["rerank"].path, folder)
    server = start_server(f"embed={arts['embed'].path}", f"rerank={folder}", num_worker=1, http=True)
    with server.client() as client:
        victim = next(w["pid"] for w in client.status()["workers"] if w["model"] == "rerank")
        _swap_model(folder, update_manifest=True)
        os.kill(victim, signal.SIGKILL)
        deadline = time.monotonic() + 120
        while "leaving it stopped" not in server.log():
            assert time.monotonic() < deadline and server.proc.poll() is None, server.log()
            time.sleep(0.2)
        with server.client(model="rerank") as rerank:
            with pytest.raises(ServerError, match="every worker of model 'rerank' stopped"):
                rerank.predict([QUERY], TASK_TEXTS[:1])
        got = httpx.post(server.url + "/rerank", json={"query": QUERY, "texts": ["a"]}, timeout=60)
        assert got.status_code == 503 and got.json()["error"].startswith("no worker of model 'rerank' is running")
        health = httpx.get(server.url + "/health", timeout=30)
        assert health.status_code == 503 and health.json()["status"] == "no worker ready for rerank"
        _within(client.encode(TASK_TEXTS), predictors["embed"].encode(TASK_TEXTS), arts["embed"])
    assert server.terminate() == 0


def test_every_task_and_tokenizer_kind_on_one_fleet(task_artifact, start_server):
    """A token classifier (BERT WordPiece), a SPLADE model (BERT), a classifier (RoBERTa BPE) and a reranker
    (DeBERTa-v2 SentencePiece) on one fleet: each request is counted with its own model's tokenizer and answered
    by its own model, equal to the in-process Predictor (the tasks' results, scores to 1e-5)."""
    models = {"ner": task_artifact("token-classification")[1], "splade": task_artifact("sparse-embedding")[1],
              "cls": task_artifact("classification", "roberta")[1], "ce": task_artifact("rerank", "deberta-v2")[1]}
    server = start_server(*(f"{n}={a.path}" for n, a in models.items()), "--no-zmq", num_worker=1, http=True)
    pred = {n: Predictor(a, threads=1) for n, a in models.items()}
    texts = ["hello world the quick brown fox", "serving models over http", "a third text"]  # 3: TEI reads 2 as a pair

    ner = httpx.post(server.url + "/predict", json={"inputs": texts, "aggregation_strategy": "first"},
                     timeout=60).json()  # /predict: the first classification or token-classification model
    want = pred["ner"].predict(texts, aggregation="first")
    assert any(want) and [[e["word"] for e in g] for g in ner] == [[e["word"] for e in w] for w in want]
    np.testing.assert_allclose([e["score"] for g in ner for e in g], [e["score"] for w in want for e in w],
                               atol=1e-5)

    cls = httpx.post(server.url + "/predict", json={"inputs": texts, "model": "cls"}, timeout=60).json()
    want = pred["cls"].predict(texts)
    assert [row[0]["label"] for row in cls] == [w["label"] for w in want]
    np.testing.assert_allclose([row[0]["score"] for row in cls], [w["score"] for w in want], atol=1e-5)

    sparse = httpx.post(server.url + "/embed_sparse", json={"inputs": texts}, timeout=60).json()
    for g, w in zip(sparse, pred["splade"].predict(texts)):
        assert [d["index"] for d in g] == w["indices"]
        np.testing.assert_allclose([d["value"] for d in g], w["values"], atol=1e-5)

    ranked = httpx.post(server.url + "/rerank", json={"query": texts[0], "texts": texts, "model": "ce"},
                        timeout=60).json()
    want = pred["ce"].rerank(texts[0], texts)
    assert [d["index"] for d in ranked] == [d["index"] for d in want]
    np.testing.assert_allclose([d["score"] for d in ranked], [d["score"] for d in want], atol=1e-5)

    tokens = httpx.post(server.url + "/tokenize", json={"inputs": "hello world", "model": "cls"}, timeout=60).json()
    assert [t["id"] for t in tokens[0]] == pred["cls"].tokenize(["hello world"])[0].ids  # RoBERTa's ids, not BERT's
    wrong = httpx.post(server.url + "/embed", json={"inputs": "x"}, timeout=30)
    assert wrong.status_code == 400 and "none of this server's models is one" in wrong.json()["error"]


def test_a_flood_refused_as_busy_on_one_model_leaves_the_other_admitted(arts, predictors, start_server):
    """Each model's queue has its own bound (--max-queued-requests): while the embedder's clients get busy replies,
    the reranker's requests are still taken and answered."""
    from concurrent.futures import ThreadPoolExecutor

    from bertopt.client import ServerBusy

    server = start_server(f"embed={arts['embed'].path}", f"rerank={arts['rerank'].path}", "--max-queued-requests",
                          "1", "--max-batch-size", "4", num_worker=1)
    texts = [f"sentence number {i} about the cat on the mat" for i in range(32)]

    def flood() -> list:
        with server.client(timeout=60) as client:
            return encode_flood(client, texts, 60, wait_s=120)

    with ThreadPoolExecutor(1) as pool:
        flooding = pool.submit(flood)
        reranked = []
        with server.client(model="rerank", timeout=60) as client:
            while not flooding.done():  # every rerank request sent while the embedder is flooded is taken
                reranked.append(client.predict([QUERY] * 4, TASK_TEXTS[:4]))
        outcomes = flooding.result()
    assert any(isinstance(o, ServerBusy) for o in outcomes)  # the embedder's queue did overflow
    assert reranked
    want = predictors["rerank"].predict([QUERY] * 4, TASK_TEXTS[:4])
    for got in reranked:
        np.testing.assert_allclose(got, want, atol=1e-6)
    with server.client() as client:
        by_model = {m["name"]: m for m in client.status()["models"]}
    assert by_model["embed"]["busy_refused"] > 0 and by_model["rerank"]["busy_refused"] == 0
