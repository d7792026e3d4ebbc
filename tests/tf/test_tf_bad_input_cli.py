"""Bad TensorFlow inputs: one clear line, exit 2, nothing half-written; and the TF recipes end to end."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.tf


def _nothing_written(out: Path) -> None:
    assert not out.exists()
    assert not list(out.parent.glob(f".{out.name}.tmp-*"))


def test_savedmodel_without_signature(tmp_path, cli):
    import tensorflow as tf

    module = tf.Module()
    module.v = tf.Variable([1.0, 2.0])
    tf.saved_model.save(module, str(tmp_path / "nosig"))
    code, _, err = cli("freeze", tmp_path / "nosig", "--out", tmp_path / "out")
    assert code == 2 and "has no serving signature" in err and "signatures=" in err
    _nothing_written(tmp_path / "out")


def test_unknown_signature_lists_the_known_ones(tiny_tf_savedmodel, tmp_path, cli):
    code, _, err = cli("freeze", tiny_tf_savedmodel.model_path, "--signature", "predict", "--out", tmp_path / "o")
    assert code == 2 and "no signature 'predict'" in err and "serving_default" in err
    _nothing_written(tmp_path / "o")


def test_checkpoint_missing_variable(google_weights, tmp_path, cli):
    from tf_conftest_helpers import GOOGLE_CONFIG, write_google_checkpoint

    weights = dict(google_weights)
    del weights["bert/encoder/layer_1/attention/self/key/kernel"]
    ckpt = write_google_checkpoint(tmp_path / "ckpt", weights, GOOGLE_CONFIG)
    code, _, err = cli("freeze", ckpt, "--out", tmp_path / "out")
    assert code == 2 and "'bert/encoder/layer_1/attention/self/key/kernel' is missing" in err
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": 1}, "'bert/encoder/layer_1/attention/output/LayerNorm/beta' is not used"),
    ({"num_hidden_layers": 3}, "'bert/encoder/layer_2/attention/output/LayerNorm/beta' is missing"),
    ({"intermediate_size": 128}, "bert/encoder/layer_0/intermediate/dense/kernel is [32, 64] but bert_config.json "
                                 "says [32, 128]"),
])
def test_config_does_not_match_checkpoint(google_weights, tmp_path, cli, change, message):
    from tf_conftest_helpers import GOOGLE_CONFIG, write_google_checkpoint

    ckpt = write_google_checkpoint(tmp_path / "ckpt", google_weights, {**GOOGLE_CONFIG, **change})
    code, _, err = cli("freeze", ckpt, "--out", tmp_path / "out")
    assert code == 2 and message in err.replace("\n", "")
    _nothing_written(tmp_path / "out")


@pytest.fixture(scope="module")
def unfrozen_graph_artifact(tiny_frozen, tmp_path_factory):
    """An artifact whose GraphDef still reads variables (a tf.function's graph, not frozen)."""
    import tensorflow as tf

    from bertopt.artifact import ArtifactWriter
    from bertopt.tf.graph import save_graph_def

    w_var = tf.Variable(tf.ones([4, 4]))

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int64, name="input_ids")])
    def f(input_ids):
        return tf.matmul(tf.cast(input_ids, tf.float32), w_var)

    graph_def = f.get_concrete_function().graph.as_graph_def()
    with ArtifactWriter(tmp_path_factory.mktemp("unfrozen") / "art", stage="freeze", parent=tiny_frozen) as w:
        w.copy_tokenizer(tiny_frozen)
        save_graph_def(graph_def, w.dir / "model.pb")
        w.set_model("model.pb", "tf-graphdef", tiny_frozen.inputs, tiny_frozen.outputs, "fp32")
    return w.artifact


@pytest.mark.parametrize("stage, extra", [("prune", []), ("quantize", ["--mode", "fp16"]),
                                          ("export", ["--to", "onnx"])])
def test_graph_that_is_not_frozen(unfrozen_graph_artifact, tmp_path, cli, stage, extra):
    code, _, err = cli(stage, unfrozen_graph_artifact.path, *extra, "--out", tmp_path / "out")
    assert code == 2 and "is not a frozen graph" in err and "bertopt freeze" in err
    _nothing_written(tmp_path / "out")


def test_freeze_refuses_a_pytorch_model(tiny_hf, tmp_path, cli):
    code, _, err = cli("freeze", tiny_hf, "--out", tmp_path / "out")
    assert code == 2 and "use 'bertopt export'" in err
    _nothing_written(tmp_path / "out")


def test_export_hf_to_savedmodel_cli(tiny_hf, tmp_path, cli):
    code, out, err = cli("export", tiny_hf, "--to", "tf-savedmodel", "--out", tmp_path / "sm")
    assert code == 0, err
    manifest = json.loads((tmp_path / "sm" / "bertopt.json").read_text())
    assert manifest["model_format"] == "tf-savedmodel" and manifest["runtime"] == "tensorflow"
    assert manifest["lineage"]["report"]["max_abs_diff_vs_pytorch"] <= 1e-4
    assert "max abs diff vs pytorch" in out


def test_google_checkpoint_recipe_end_to_end(tiny_ckpt, tmp_path, cli, monkeypatch):
    """bertopt run recipes/google-ckpt-fp16.yaml --model CKPT: freeze -> prune -> fp16 -> ONNX, compared with
    the checkpoint run in TensorFlow."""
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "google-ckpt-fp16.yaml"
    code, out, err = cli("run", recipe, "--model", tiny_ckpt, "--out", tmp_path / "runs")
    assert code == 0, err + out
    final = tmp_path / "runs" / "google-ckpt-fp16" / "04-export"
    manifest = json.loads((final / "bertopt.json").read_text())
    assert manifest["model_format"] == "onnx" and manifest["precision"] == "fp16"
    cmp = manifest["validation"]["run"]
    assert cmp["reference"]["framework"] == "tensorflow"
    assert cmp["accuracy"]["sentence_embedding"]["nan_or_inf"] == 0
    assert cmp["accuracy"]["sentence_embedding"]["cos_min"] > 0.999
    assert [h["stage"] for h in manifest["history"]] == ["freeze", "prune", "quantize"]


def _foreign_copy(tiny_tf_savedmodel, dest: Path) -> Path:
    """The tiny SavedModel without any config file next to it: nothing but the graph says how many positions it
    has (64)."""
    import shutil

    shutil.copytree(tiny_tf_savedmodel.model_path, dest)
    (dest / "assets").mkdir(exist_ok=True)
    for file in tiny_tf_savedmodel.tokenizer_path.iterdir():
        if file.name in ("vocab.txt", "tokenizer.json"):
            shutil.copy2(file, dest / "assets" / file.name)
    for name in ("config.json", "bert_config.json"):
        for where in (dest, dest / "assets"):
            (where / name).unlink(missing_ok=True)
    return dest


def test_position_limit_is_read_from_the_graph(tiny_tf_savedmodel, tmp_path, cli):
    foreign = _foreign_copy(tiny_tf_savedmodel, tmp_path / "foreign")
    code, _, err = cli("freeze", foreign, "--out", tmp_path / "frozen")
    assert code == 0, err
    manifest = json.loads((tmp_path / "frozen" / "bertopt.json").read_text())
    assert manifest["model"]["max_position_embeddings"] == 64 and manifest["model"]["max_seq_len"] == 64


def test_max_seq_len_beyond_the_position_table_is_refused(tiny_tf_savedmodel, tmp_path, cli):
    foreign = _foreign_copy(tiny_tf_savedmodel, tmp_path / "foreign")
    code, _, err = cli("freeze", foreign, "--max-seq-len", "100", "--out", tmp_path / "frozen")
    assert code == 2 and "exceeds the 64 positions" in err and "--max-seq-len 64" in err
    assert len(err.strip().splitlines()) == 1
    _nothing_written(tmp_path / "frozen")


# -- hostile checkpoint folders and .keras files (what they name, how big they claim to be) ------------------
def _checkpoint_copy(tiny_ckpt, tmp_path) -> Path:
    import shutil

    folder = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, folder)
    return folder


def test_a_token_type_past_the_checkpoints_table_is_refused(tiny_ckpt, tmp_path, cli):
    # the Keras BERT gathers token types from a table of type_vocab_size rows: a tokenizer giving a pair's second
    # text type 5 exported fine, then TensorFlow failed every pair on a CPU (on a GPU its gather returns zeros)
    from tokenizer_edits import pair_type_past_table

    from bertopt.sources.hf import build_wordpiece_tokenizer

    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    data = json.loads(build_wordpiece_tokenizer(folder / "vocab.txt", True).to_str())
    pair_type_past_table(data)
    (folder / "tokenizer.json").write_text(json.dumps(data))
    code, _, err = cli("freeze", folder, "--out", tmp_path / "a")
    assert code == 2, err
    assert "gives the second text of a pair the token type 5, but the model's token-type table has 2 rows" in err
    assert len(err.strip().splitlines()) == 1
    _nothing_written(tmp_path / "a")


def test_a_checkpoint_state_file_cannot_lead_to_weights_elsewhere(tiny_ckpt, tmp_path, cli):
    """A folder named like the checkpoint prefix, holding a 'checkpoint' file that names weights outside: TensorFlow
    read those (the artifact held weights from anywhere on the machine)."""
    import shutil

    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    prefix = next(folder.glob("*.index")).with_suffix("")
    for file in folder.glob(prefix.name + ".*"):
        shutil.move(file, elsewhere / file.name)
    (folder / (prefix.name + ".index")).write_bytes(b"")  # what the glob finds
    prefix.mkdir()
    (prefix / "checkpoint").write_text(f'model_checkpoint_path: "{elsewhere / prefix.name}"\n')
    code, _, err = cli("freeze", folder, "--out", tmp_path / "out")
    assert code == 2 and "TensorFlow would read it as a checkpoint folder" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("change, message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be a positive whole number, got 0"),
    ({"num_attention_heads": 3}, "hidden_size 32 is not a multiple of num_attention_heads 3"),
    ({"vocab_size": "abc"}, "vocab_size must be a positive whole number, got 'abc'"),
    ({"vocab_size": [1]}, "vocab_size must be a positive whole number, got [1]"),
    ({"layer_norm_eps": "x"}, "layer_norm_eps must be a small positive number"),
    # checked against the checkpoint's index before any variable is made (this one allocated 64 GB)
    ({"vocab_size": 2_000_000_000}, "bert/embeddings/word_embeddings is [")])
def test_bert_config_values_are_checked_before_anything_is_built(tiny_ckpt, tmp_path, cli, change, message):
    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    config = json.loads((folder / "bert_config.json").read_text())
    (folder / "bert_config.json").write_text(json.dumps({**config, **change}))
    code, _, err = cli("freeze", folder, "--out", tmp_path / "out")
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    _nothing_written(tmp_path / "out")


@pytest.mark.parametrize("what", ["bert_config.json is a FIFO", "vocab.txt links outside"])
def test_checkpoint_folder_files_must_be_its_own_regular_files(tiny_ckpt, tmp_path, cli, what):
    import os

    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    if what == "bert_config.json is a FIFO":
        (folder / "bert_config.json").unlink()
        os.mkfifo(folder / "bert_config.json")
        message = "bert_config.json is not a regular file"
    else:
        secret = tmp_path / "secret.txt"
        secret.write_text("a private file\n")
        (folder / "vocab.txt").unlink()
        (folder / "vocab.txt").symlink_to(secret)
        message = f"vocab.txt is a link to {secret}, outside the model folder"
    code, _, err = cli("freeze", folder, "--out", tmp_path / "out")  # the FIFO hung this for ever
    assert code == 2 and message in err, err
    _nothing_written(tmp_path / "out")


def test_a_truncated_checkpoint_is_one_line(tiny_ckpt, tmp_path, cli):
    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    data = next(folder.glob("*.data-*"))
    data.write_bytes(data.read_bytes()[:100])
    code, _, err = cli("freeze", folder, "--out", tmp_path / "out")
    assert code == 2 and "cannot read the checkpoint" in err and "Traceback" not in err, err
    _nothing_written(tmp_path / "out")


def test_a_keras_file_whose_config_unpacks_to_gigabytes_is_refused_unread(tiny_keras_file, tmp_path, cli):
    import zipfile

    bomb = tmp_path / "bomb.keras"
    with zipfile.ZipFile(tiny_keras_file) as src, zipfile.ZipFile(bomb, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            if info.filename == "config.json":
                data = data[:-1] + b" " * (20 << 20) + data[-1:]  # 20 MiB of spaces: a few kB packed
            out.writestr(info.filename, data)
    assert bomb.stat().st_size < 1 << 20
    code, _, err = cli("freeze", bomb, "--out", tmp_path / "out")
    assert code == 2 and "config.json unpacks to" in err and "zip bomb" in err, err
    _nothing_written(tmp_path / "out")


def _one_line(code, err, out: Path, message: str) -> None:
    assert code == 2 and message in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    _nothing_written(out)


@pytest.mark.parametrize("change, drop, message", [
    # each was built zero-filled before the checkpoint was compared: 3.2-3.8 GB and 13-15 s from a 100 kB folder,
    # and minutes for the layers
    ({"intermediate_size": 5_000_000}, None,
     "bert/encoder/layer_0/intermediate/dense/kernel is [32, 64] but bert_config.json says [32, 5000000]"),
    ({"type_vocab_size": 25_000_000}, None,
     "bert/embeddings/token_type_embeddings is [2, 32] but bert_config.json says [25000000, 32]"),
    ({"num_hidden_layers": 200_000}, None, "num_hidden_layers is 200,000, more than the 256 an encoder has"),
    ({"vocab_size": 25_000_000}, "bert/embeddings/word_embeddings",
     "variable 'bert/embeddings/word_embeddings' is missing"),
])
def test_a_checkpoint_is_held_to_its_config_before_anything_is_allocated(google_weights, tmp_path, cli, change, drop,
                                                                          message):
    from tf_conftest_helpers import GOOGLE_CONFIG, write_google_checkpoint

    weights = {k: v for k, v in google_weights.items() if k != drop}
    ckpt = write_google_checkpoint(tmp_path / "ckpt", weights, {**GOOGLE_CONFIG, **change})
    code, _, err = cli("freeze", ckpt, "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", message)


@pytest.mark.parametrize("damage, message", [
    ("strings", "bert/embeddings/LayerNorm/beta holds string values, not numbers"),
    ("nan", "variable 'bert/encoder/layer_1/output/dense/bias' holds NaN or infinite values"),
])
@pytest.mark.parametrize("command", [["freeze"], ["export", "--to", "tf-savedmodel"]])
def test_checkpoint_weights_that_are_not_numbers(google_weights, tmp_path, cli, damage, message, command):
    # a string tensor was a ValueError traceback; NaN weights exported an all-NaN SavedModel with exit 0, and freeze
    # blamed itself ("please report it")
    import numpy as np
    from tf_conftest_helpers import GOOGLE_CONFIG, write_google_checkpoint

    weights = dict(google_weights)
    if damage == "strings":
        weights["bert/embeddings/LayerNorm/beta"] = np.array([b"x"] * 32)
    else:
        bias = weights["bert/encoder/layer_1/output/dense/bias"].copy()
        bias[3] = np.nan
        weights["bert/encoder/layer_1/output/dense/bias"] = bias
    ckpt = write_google_checkpoint(tmp_path / "ckpt", weights, GOOGLE_CONFIG)
    code, _, err = cli(command[0], ckpt, *command[1:], "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", message)


@pytest.mark.parametrize("command", [["freeze"], ["export", "--to", "tf-savedmodel"]])
def test_a_vocabulary_larger_than_the_embedding_table_is_refused(tiny_ckpt, tmp_path, cli, command):
    # exported with exit 0; texts with the extra tokens then failed in TensorFlow (a traceback, and exit 1 from
    # validate), where a GPU returns zeros for them instead
    folder = _checkpoint_copy(tiny_ckpt, tmp_path)
    with open(folder / "vocab.txt", "a") as fh:
        fh.write("".join(f"extra{i}\n" for i in range(100)))
    code, _, err = cli(command[0], folder, *command[1:], "--out", tmp_path / "out")
    rows = json.loads((folder / "bert_config.json").read_text())["vocab_size"]
    _one_line(code, err, tmp_path / "out", f"but the model's embedding table has {rows} rows")


def test_a_savedmodel_with_a_truncated_variables_file_is_one_line(tiny_tf_savedmodel, tmp_path, cli, copy_of):
    folder = copy_of(tiny_tf_savedmodel.model_path, tmp_path / "sm")
    data = next((folder / "variables").glob("variables.data-*"))
    data.write_bytes(data.read_bytes()[:len(data.read_bytes()) // 2])  # an IndexError traceback
    code, _, err = cli("freeze", folder, "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", "is the folder complete")


def _keras_with_config(tiny_keras_file, dest: Path, edit) -> Path:
    import zipfile

    with zipfile.ZipFile(tiny_keras_file) as src, zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as out:
        for info in src.infolist():
            data = src.read(info.filename)
            out.writestr(info.filename, edit(data) if info.filename == "config.json" else data)
    return dest


def _first_layer(class_name: str, key: str, value):
    def edit(data: bytes) -> bytes:
        config = json.loads(data)
        layer = next(layer for layer in config["config"]["layers"] if layer["class_name"] == class_name)
        layer["config"][key] = value
        return json.dumps(config).encode()
    return edit


@pytest.mark.parametrize("class_name, key, value", [
    ("Embedding", "input_dim", 50_000_000),  # 3.8 GB and 19 s, then a traceback
    ("Embedding", "input_dim", 2_000_000_000),  # 128 GB asked
    ("Dense", "units", 1_000_000_000),  # 64 GB asked
])
def test_keras_layer_sizes_are_held_to_the_weights_before_keras_builds_them(tiny_keras_file, tmp_path, cli,
                                                                            class_name, key, value):
    bad = _keras_with_config(tiny_keras_file, tmp_path / "big.keras", _first_layer(class_name, key, value))
    code, _, err = cli("freeze", bad, "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", "the config does not belong to these weights")


def test_a_keras_config_nested_200000_deep_is_one_line(tiny_keras_file, tmp_path, cli):
    deep = _keras_with_config(tiny_keras_file, tmp_path / "deep.keras",
                              lambda data: b"[" * 200_000 + b"]" * 200_000)  # a RecursionError traceback
    code, _, err = cli("freeze", deep, "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", "config.json nests deeper than Python can read")


def test_a_tensorflow_graph_that_fails_on_a_batch_is_a_model_run_error(tiny_frozen):
    # an id past the embedding table fails inside TensorFlow on a CPU: one line (ModelRunError), not a traceback
    import numpy as np

    from bertopt.errors import ModelRunError
    from bertopt.runtime import Predictor

    session = Predictor(tiny_frozen, provider="cpu").session
    feeds = {name: np.zeros((1, 4), dtype=np.int64) for name in session.input_names}
    feeds["input_ids"] = np.array([[2, 10_000_000, 5, 3]])
    with pytest.raises(ModelRunError, match="failed to run in TensorFlow: .*10000000"):
        session.run(session.output_names, feeds)


def test_layer_sizes_count_weights_not_sequence_lengths():
    # a Keras BERT built for a fixed length (Input((512,))) was refused: the 512 of each layer's build_config was
    # counted as a weight size (a BERT-mini of 11 M parameters read as 298 M); a recurrent kernel is units x 4 units
    from bertopt.tf.sources import _layer_parameters

    def layer(class_name, config, input_shape):
        return {"class_name": class_name, "config": {"name": "x", "seed": 1234567, **config},
                "build_config": {"input_shape": input_shape}}

    assert _layer_parameters(layer("Embedding", {"input_dim": 30522, "output_dim": 256}, [None, 512])) == 30522 * 256
    assert _layer_parameters(layer("Dense", {"units": 1024}, [None, 512, 256])) == 1024 * 256
    assert _layer_parameters(layer("LayerNormalization", {"axis": -1}, [None, 512, 256])) == 256
    assert _layer_parameters(layer("LSTM", {"units": 100, "recurrent_initializer": {}}, [None, 512, 16])) \
        == 100 * 16 * 4 * 100
    assert _layer_parameters(layer("Conv2D", {"filters": 8, "kernel_size": [3, 3], "strides": [1, 1]},
                                   [None, 28, 28, 4])) == 8 * 3 * 3 * 4


def test_a_keras_bert_encoder_is_held_to_its_token_type_table(tmp_path, cli):
    # bertopt's own encoder layer: its type_vocab_size was left out of the sizes held to the weights (3-4 GB)
    import keras

    from bertopt.tf._layers import BertEncoder

    encoder = BertEncoder(vocab_size=40, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                          intermediate_size=32, max_position_embeddings=32, type_vocab_size=2, pooling="mean",
                          name="bert_encoder")
    inputs = {n: keras.Input((None,), dtype="int64", name=n) for n in ("input_ids", "attention_mask", "token_type_ids")}
    keras.Model(inputs, encoder(inputs)).save(tmp_path / "ok.keras")
    bad = _keras_with_config(tmp_path / "ok.keras", tmp_path / "types.keras", lambda data: json.dumps(
        _set_everywhere(json.loads(data), "type_vocab_size", 25_000_000)).encode())
    code, _, err = cli("freeze", bad, "--out", tmp_path / "out")
    _one_line(code, err, tmp_path / "out", "the config does not belong to these weights")


def _set_everywhere(value, key, new):
    if isinstance(value, dict):
        return {k: (new if k == key else _set_everywhere(v, key, new)) for k, v in value.items()}
    if isinstance(value, list):
        return [_set_everywhere(v, key, new) for v in value]
    return value
