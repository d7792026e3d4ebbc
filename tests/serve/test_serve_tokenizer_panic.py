"""A text that makes the artifact's Rust tokenizer panic (pyo3's PanicException, a BaseException no ``except
Exception`` sees) reaches a real ``bertopt serve`` on 127.0.0.1: the official openai client gets a JSON 400 naming
it, the ZeroMQ client an error reply, and both go on being served."""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.server]

PANICKING_TEXT = "a" * 40 + "!"


@pytest.fixture(scope="module")
def panicking_artifact(tiny_hf, tmp_path_factory):
    import json
    import shutil

    from bertopt.registry import run_stage

    root = tmp_path_factory.mktemp("panicking")
    shutil.copytree(tiny_hf, root / "hf")
    file = root / "hf" / "tokenizer.json"
    spec = json.loads(file.read_text())
    # passes the nested-quantifier check, still exhausts the regex engine's retry limit on PANICKING_TEXT
    split = {"type": "Split", "pattern": {"Regex": "(a|a)*$"}, "behavior": "Isolated", "invert": False}
    spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [split, spec["pre_tokenizer"]]}
    file.write_text(json.dumps(spec))
    return run_stage("export", str(root / "hf"), {}, root / "art")


def test_a_text_that_panics_the_tokenizer_gets_an_error_reply_and_the_server_serves_on(panicking_artifact,
                                                                                        start_server):
    from openai import BadRequestError, OpenAI

    from bertopt.client import ServerError

    server = start_server(panicking_artifact.path, num_worker=1, http=True)
    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    with pytest.raises(BadRequestError) as err:
        client.embeddings.create(input=[PANICKING_TEXT], model="m")
    assert err.value.status_code == 400
    assert "the model's tokenizer cannot encode this text" in err.value.body["message"], err.value.body
    assert len(client.embeddings.create(input=["a fine text"], model="m").data) == 1
    with server.client() as zmq_client:
        with pytest.raises(ServerError, match="the model's tokenizer cannot encode this text"):
            zmq_client.encode([PANICKING_TEXT])
        assert zmq_client.encode(["a fine text"]).shape == (1, 32)
    assert server.proc.poll() is None
