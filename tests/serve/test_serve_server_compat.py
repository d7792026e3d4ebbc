"""The unchanged BertClient of bert-serving-client 1.10.0 against bertopt serve, and a MiniLM round trip."""

from __future__ import annotations

import numpy as np
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.server, pytest.mark.timeout(300)]

SENTENCES = ["First do it", "then do it right", "then do it better", "the cat sat on the mat"]


def test_bert_serving_client_encodes(tiny_server, tiny_predictor, capsys):
    from bert_serving.client import BertClient

    # default checks on: version, max_seq_len, token info (it asks for the config when it connects)
    with BertClient(ip="127.0.0.1", port=tiny_server.port, port_out=tiny_server.port_out, timeout=30000,
                    show_server_config=True) as bc:
        assert "server_version" in capsys.readouterr().out
        vectors = bc.encode(SENTENCES)
        tokenized = bc.encode([s.split() for s in SENTENCES], is_tokenized=True)
        assert bc.server_status["requests"] >= 2
        # non-blocking sends, fetched in order
        for s in SENTENCES:
            bc.encode([s], blocking=False)
        fetched = bc.fetch_all(sort=True, concat=True)
    want = tiny_predictor.encode(SENTENCES)
    assert isinstance(vectors, np.ndarray) and vectors.dtype == np.float32 and vectors.shape == want.shape
    np.testing.assert_allclose(vectors, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(tokenized, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(fetched, want, atol=1e-5, rtol=0)


def test_minilm_round_trip(minilm_onnx, start_server):
    from bert_serving.client import BertClient

    from bertopt.runtime import Predictor

    texts = SENTENCES + [" ".join(["a very long sentence about serving models"] * 80)]  # > 256 tokens
    server = start_server(minilm_onnx.path, num_worker=1)
    with server.client() as client:
        got = client.encode(texts)
    with BertClient(ip="127.0.0.1", port=server.port, port_out=server.port_out, timeout=60000) as bc:
        got_bc = bc.encode(texts)
    want = Predictor(minilm_onnx).encode(texts)
    assert got.shape == (5, 384)
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
    np.testing.assert_allclose(got_bc, want, atol=1e-5, rtol=0)


def test_bert_serving_client_sees_the_error_of_a_hostile_text_and_the_server_lives_on(tiny_server, tiny_predictor):
    """A lone surrogate used to end the server; BertClient (unchanged) now gets the error reply, which it reads
    as a dtype and so raises naming the message, and its next request is answered."""
    from bert_serving.client import BertClient

    with BertClient(ip="127.0.0.1", port=tiny_server.port, port_out=tiny_server.port_out, timeout=30000,
                    check_version=False, check_length=False) as bc:
        # numpy's refusal of the message as a dtype: TypeError or ValueError depending on the text
        with pytest.raises((TypeError, ValueError), match=r"bertopt serve error: text 1 holds a lone surrogate"):
            bc.encode(["fine", "a\ud800b"])
        np.testing.assert_allclose(bc.encode(SENTENCES), tiny_predictor.encode(SENTENCES), atol=1e-5, rtol=0)
