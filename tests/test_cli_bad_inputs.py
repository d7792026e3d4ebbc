"""The bad-input corpus: each case runs the real ``bertopt`` command in a subprocess, as a user would, and must
end with exit code 2, exactly one line on stderr naming the problem (and the fix), no traceback, and nothing
left behind where the command would have written.

A case is (id, setup): ``setup(ctx)`` builds what the case needs under ``ctx.tmp`` and returns the argv, the
text the error line must contain, and the paths that must not exist afterwards.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tokenizer_edits import pair_type_past_table

from bertopt.harness import free_port

UNWRITABLE = "/proc/bertopt-cannot-write-here"  # refused even to root (procfs)


@dataclass
class Ctx:
    tmp: Path
    tiny: Path  # a tiny BERT ONNX artifact (session fixture)
    tiny_hf: Path  # the tiny Hugging Face folder it was exported from

    def copy_artifact(self, name: str = "art") -> Path:
        dest = self.tmp / name
        shutil.copytree(self.tiny, dest)
        return dest

    def edited_manifest(self, edit) -> Path:
        """A copy of the tiny artifact whose bertopt.json went through ``edit(manifest) -> manifest``."""
        dest = self.copy_artifact("edited")
        path = dest / "bertopt.json"
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))
        return dest

    def nul_file(self, name: str = "nul.txt") -> Path:
        path = self.tmp / name
        path.write_bytes(b"\x00" * 64 + b"\n" + b"\x00" * 64 + b"\n")
        return path

    def recipe(self, text: str) -> Path:
        return self.write("recipe.yaml", text)

    def write(self, name: str, text: str) -> Path:
        path = self.tmp / name
        path.write_text(text)
        return path

    def fifo(self, name: str) -> Path:
        path = self.tmp / name
        os.mkfifo(path)
        return path

    def ensure_file(self, name: str) -> Path:
        return self.write(name, "not a folder\n")

    def st_onnx_folder(self, name: str = "st", token_states_only: bool = True) -> Path:
        """sentence-transformers' ONNX layout: the tiny model's folder (config, tokenizer, modules.json) without
        its PyTorch weights, and ``onnx/model.onnx`` (the tiny artifact's graph; ``token_states_only``: with its
        one output ``last_hidden_state``, as Optimum's feature-extraction export writes it)."""
        import onnx

        folder = self.tmp / name
        shutil.copytree(self.tiny_hf, folder, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
        model = onnx.load(str(self.tiny / "model.onnx"))
        if token_states_only:
            keep = [o for o in model.graph.output if o.name == "last_hidden_state"]
            del model.graph.output[:]
            model.graph.output.extend(keep)
        (folder / "onnx").mkdir()
        onnx.save(model, str(folder / "onnx" / "model.onnx"))
        return folder

    def st_module(self, folder: Path, module_type: str, config: dict | None = None) -> Path:
        """``folder``'s modules.json with one more module (its config.json in ``<idx>_<Name>/``)."""
        modules = json.loads((folder / "modules.json").read_text())
        idx = len(modules)
        path = f"{idx}_{module_type.rsplit('.', 1)[-1]}"
        modules.append({"idx": idx, "name": str(idx), "path": path, "type": module_type})
        (folder / "modules.json").write_text(json.dumps(modules))
        (folder / path).mkdir()
        (folder / path / "config.json").write_text(json.dumps(config or {}))
        return folder / path

    def parquet(self, name: str) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.tmp / name
        pq.write_table(pa.table({"text": ["a sentence", "another one"]}), str(path))
        return path


def _drop(key):
    def edit(m):
        m.pop(key)
        return m
    return edit


def _set(key, value):
    def edit(m):
        m[key] = value
        return m
    return edit


def _dense_as_bin(c: Ctx) -> Path:
    """An ONNX export whose folder's pipeline has a Dense saved as pytorch_model.bin."""
    import torch

    folder = c.st_onnx_folder()
    dense = c.st_module(folder, "sentence_transformers.models.Dense",
                        {"in_features": 32, "out_features": 8, "bias": True,
                         "activation_function": "torch.nn.modules.activation.Tanh"})
    linear = torch.nn.Linear(32, 8)
    torch.save({"linear.weight": linear.weight.detach(), "linear.bias": linear.bias.detach()},
               str(dense / "pytorch_model.bin"))
    return folder


def _hf_with_dense(c: Ctx, config: dict, shape: tuple[int, int] | None = (8, 32), pickle_payload: bool = False):
    """The tiny model folder with a Dense module of ``config`` whose model.safetensors holds weights of ``shape``
    (and a bias), or whose pytorch_model.bin is a pickle that would run code when unpickled."""
    import pickle

    import torch
    from safetensors.torch import save_file

    folder = _hf_copy(c)
    dense = c.st_module(folder, "sentence_transformers.models.Dense",
                        {"activation_function": "torch.nn.modules.activation.Tanh", **config})
    if shape:
        save_file({"linear.weight": torch.randn(*shape), "linear.bias": torch.randn(shape[0])},
                  str(dense / "model.safetensors"))
    if pickle_payload:
        class Payload:
            def __reduce__(self):
                return (os.system, (f"touch {c.tmp / 'PWNED'}",))
        (dense / "pytorch_model.bin").write_bytes(pickle.dumps({"weight": Payload()}))
    return folder


def _with_module(c: Ctx, module_type: str) -> Path:
    folder = c.st_onnx_folder()
    c.st_module(folder, module_type, {"word_embedding_dimension": 32, "hidden_dim": 8})
    return folder


def _openvino_export(c: Ctx) -> Path:
    """What SentenceTransformer(folder, backend="openvino").save(folder) leaves: openvino/openvino_model.xml + .bin
    (the IR of the same graph) beside the model's files."""
    import openvino as ov

    folder = c.st_onnx_folder("ov")
    (folder / "openvino").mkdir()
    ov.save_model(ov.convert_model(str(folder / "onnx" / "model.onnx")),
                  str(folder / "openvino" / "openvino_model.xml"))
    shutil.rmtree(folder / "onnx")
    return folder


def _linked_artifact(c: Ctx) -> Path:
    """The tiny artifact reached through a symlinked parent folder: ``link/art`` where ``link`` -> ``real``."""
    (c.tmp / "real").mkdir()
    shutil.copytree(c.tiny, c.tmp / "real" / "art")
    (c.tmp / "link").symlink_to(c.tmp / "real")
    return c.tmp / "link" / "art"


def _user_folder(c: Ctx, name: str) -> Path:
    folder = c.tmp / name
    folder.mkdir(parents=True)
    (folder / "notes.txt").write_text("my own file\n")
    return folder


def _artifact_with_outside_link(c: Ctx) -> Path:
    """A copy of the tiny artifact whose tokenizer folder gained a symlink to a file outside the artifact."""
    art = c.copy_artifact()
    secret = c.write("secret.txt", "not part of any artifact\n")
    (art / "tokenizer" / "extra.txt").symlink_to(secret)
    return art


def _report_folder(c: Ctx) -> Path:
    folder = c.tmp / "report"
    folder.mkdir()
    (folder / "validation.json").write_text("{}")
    return folder


def _onnx_source(c: Ctx, name: str, outputs=(("sentence_embedding", ["batch", 32]),), input_type: int = 7,
                 external: str | None = None, config: bool = True, computed_as_declared: bool = True) -> Path:
    """A hand-made ONNX graph in a folder with the tiny model's tokenizer (and config.json): inputs input_ids and
    attention_mask of ``input_type``; each output (name, declared shape) computed from the ids, in that shape
    (``computed_as_declared``) or as the ids themselves (batch x sequence, whatever it declares); ``external``: one
    weight kept in an external data file of that name."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as h

    folder = c.tmp / name
    folder.mkdir()
    for file in ("vocab.txt", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json") + \
            (("config.json",) if config else ()):
        if (c.tiny_hf / file).exists():
            shutil.copy2(c.tiny_hf / file, folder / file)
    inputs = [h.make_tensor_value_info(n, input_type, ["batch", "sequence"]) for n in ("input_ids", "attention_mask")]
    nodes = [h.make_node("Cast", ["input_ids"], ["ids_f"], to=TensorProto.FLOAT)]
    inits = []
    if external:
        weight = onnx.TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[4, 32],
                                  data_location=TensorProto.EXTERNAL)
        for key, value in (("location", external), ("offset", "0"), ("length", "512")):
            entry = weight.external_data.add()
            entry.key, entry.value = key, value
        inits.append(weight)
        (folder / external).parent.mkdir(parents=True, exist_ok=True)
        (folder / external).write_bytes(np.ones(128, np.float32).tobytes())
        nodes.append(h.make_node("ReduceSum", ["w"], ["w_sum"], keepdims=0))
        nodes.append(h.make_node("Mul", ["ids_f", "w_sum"], ["ids_w"]))
    source = "ids_w" if external else "ids_f"
    for out, shape in outputs:
        if computed_as_declared and len(shape) in (2, 3):
            # the declared shape, computed from the ids: batch x width (each text's id sum, repeated), or batch x
            # sequence x width (each id, repeated); a symbolic width comes out as 4
            width = shape[-1] if isinstance(shape[-1], int) and shape[-1] <= 1024 else 4
            inits.append(numpy_helper.from_array(np.ones([1] * (len(shape) - 1) + [width], np.float32),
                                                      f"{out}_ones"))
            if len(shape) == 2:
                nodes.append(h.make_node("ReduceSum", [source, "axis1"], [f"{out}_sum"], keepdims=1))
                if "axis1" not in {i.name for i in inits}:
                    inits.append(numpy_helper.from_array(np.array([1], np.int64), "axis1"))
            else:
                nodes.append(h.make_node("Unsqueeze", [source, "axis_last"], [f"{out}_sum"]))
                if "axis_last" not in {i.name for i in inits}:
                    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axis_last"))
            nodes.append(h.make_node("Mul", [f"{out}_sum", f"{out}_ones"], [out]))
        else:
            nodes.append(h.make_node("Identity", [source], [out]))
    graph = h.make_graph(nodes, "g", inputs, [h.make_tensor_value_info(out, TensorProto.FLOAT, shape)
                                              for out, shape in outputs], inits)
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _allocation_bomb_source(c: Ctx, name: str = "bomb-src") -> Path:
    """A 300-byte graph whose ConstantOfShape asks for 4 TB as it runs."""
    import numpy as np
    import onnx
    from onnx import TensorProto, numpy_helper
    from onnx import helper as h

    model_file = _onnx_source(c, name)
    model = onnx.load(str(model_file))
    cast = next(n for n in model.graph.node if n.op_type == "Cast")
    cast.output[0] = "ids_raw"  # ids_f = ids + sum(4 TB of ones): every output needs the allocation
    model.graph.initializer.append(numpy_helper.from_array(np.array([1_000_000, 1_000_000], np.int64), "shape"))
    model.graph.node.insert(0, h.make_node("ConstantOfShape", ["shape"], ["big"],
                                           value=h.make_tensor("v", TensorProto.FLOAT, [1], [1.0])))
    model.graph.node.insert(1, h.make_node("ReduceSum", ["big"], ["big_sum"], keepdims=0))
    model.graph.node.insert(3, h.make_node("Add", ["ids_raw", "big_sum"], ["ids_f"]))  # after the Cast
    onnx.save(model, str(model_file))
    return model_file


def _artifact_with_graph(c: Ctx, graph: Path, name: str) -> Path:
    """An artifact (its files hashed as a stage would) running ``graph``: export runs an imported graph once and
    refuses one that fails or computes other shapes than it declares, so the artifact is made from a sound graph
    and this one swapped in, as a hand-made or tampered-and-rehashed artifact would have it."""
    from bertopt.artifact import _digest_of_files, sha256_file
    from bertopt.registry import run_stage

    folder = run_stage("export", str(_onnx_source(c, f"{name}-sound-src")), {}, c.tmp / name).path
    shutil.copy2(graph, folder / "model.onnx")
    manifest = json.loads((folder / "bertopt.json").read_text())
    manifest["files"]["model.onnx"] = {"size": (folder / "model.onnx").stat().st_size,
                                       "sha256": sha256_file(folder / "model.onnx")}
    manifest["digest"] = _digest_of_files(manifest["files"])
    (folder / "bertopt.json").write_text(json.dumps(manifest))
    return folder


def _allocation_bomb(c: Ctx) -> Path:
    """An artifact whose graph asks for 4 TB as it runs: ONNX Runtime's allocation failure was a traceback and
    exit 1, read by CI as "gate failed"."""
    return _artifact_with_graph(c, _allocation_bomb_source(c), "bomb")


def _graph_wider_than_declared(c: Ctx) -> Path:
    """An artifact declaring a 32-wide sentence_embedding whose graph returns one as wide as the batch's
    longest text: stacking rows of different widths was a numpy ValueError traceback, exit 1."""
    return _artifact_with_graph(c, _onnx_source(c, "liar-src", computed_as_declared=False), "liar")


def _sparse(c: Ctx, name: str, size: int) -> Path:
    path = c.tmp / name
    with open(path, "wb") as fh:
        fh.truncate(size)  # sparse: no disk used, read whole it is `size` bytes of memory
    return path


def _parquet_bomb(c: Ctx) -> Path:
    """Two million rows of one dictionary-encoded string: a few KB on disk."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    n = 2_000_000
    column = pa.DictionaryArray.from_arrays(pa.array([0] * n, pa.int8()), pa.array(["hello world"]))
    path = c.tmp / "bomb.parquet"
    pq.write_table(pa.table({"text": column}), str(path), compression="zstd")
    return path


def _fleet_file(c: Ctx, entry: str) -> Path:
    return c.write("fleet.yaml", f"models:\n  emb:\n    artifact: {c.tiny}\n    {entry}\n")


def _alias_bomb(levels: int = 9) -> str:
    """'billion laughs': each level is 9 aliases of the one before, 9**levels strings once expanded."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]")
    return "\n".join(lines) + "\nstages: [export]\n"


def _recipe_with_later_stage_folder_of_user_files(c: Ctx) -> tuple[Path, Path]:
    out = c.tmp / "a"
    _user_folder(c, "a/r/02-quantize")
    return c.recipe(f"name: r\nmodel: {c.tiny_hf}\nstages:\n  - export: {{}}\n  - quantize: {{}}\n"), out


def _hf_copy(c: Ctx) -> Path:
    shutil.copytree(c.tiny_hf, c.tmp / "hf")
    return c.tmp / "hf"


def _hf_edited(c: Ctx, file: str, edit) -> Path:
    """A copy of the tiny model folder whose JSON ``file`` went through ``edit(data) -> data`` (a str: the text)."""
    folder = _hf_copy(c)
    path = folder / file
    data = edit(json.loads(path.read_text()))
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return folder


def _hf_weights_without(c: Ctx, dropped: str, **config) -> Path:
    """The tiny model folder whose model.safetensors lacks the tensors whose names hold ``dropped``, its config.json
    with ``config`` set: transformers filled what is missing with random numbers, silently."""
    from safetensors.torch import load_file, save_file

    folder = _hf_edited(c, "config.json", lambda m: {**m, **config})
    weights = folder / "model.safetensors"
    save_file({k: v for k, v in load_file(str(weights)).items() if dropped not in k}, str(weights),
              metadata={"format": "pt"})
    return folder


def _hf_slow_tokenizer(c: Ctx, files: dict[str, str]) -> Path:
    """The tiny model folder without tokenizer.json, its tokenizer to be built from ``files`` (name -> text)."""
    folder = _hf_copy(c)
    (folder / "tokenizer.json").unlink()
    (folder / "vocab.txt").unlink()
    for name, text in files.items():
        (folder / name).write_text(text)
    return folder


def _xlmr(c: Ctx, name: str = "xlmr") -> Path:
    """A tiny XLM-RoBERTa folder (a SentencePiece Unigram tokenizer, tokenizer.json)."""
    from bertopt.tiny_models import build_tiny_family_model

    return build_tiny_family_model(c.tmp / name, "xlm-roberta", "embedding")


def _sentencepiece_model(rules: dict[str, str] | None = None) -> bytes:
    """A real SentencePiece .model trained on the built-in corpus; ``rules``: extra normalisation (a character to
    its replacement), compiled by sentencepiece's own trainer into the model's precompiled_charsmap."""
    import io
    import tempfile

    import sentencepiece as spm

    from bertopt.data import corpus

    with tempfile.TemporaryDirectory() as tmp:
        extra = {}
        if rules:
            tsv = Path(tmp) / "rules.tsv"
            tsv.write_text("".join(f"{ord(k):X}\t{' '.join(f'{ord(ch):X}' for ch in v)}\n" for k, v in rules.items()))
            extra["normalization_rule_tsv"] = str(tsv)
        buf = io.BytesIO()
        # with rules, trained on digits they leave alone: trained on letters that each become 10,000, it ran for minutes
        texts = ["0123456789 9876543210 1 22 333"] * 20 if rules else corpus()
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_writer=buf, vocab_size=300,
                                       model_type="unigram", minloglevel=2, hard_vocab_limit=False, **extra)
    return buf.getvalue()


def _charsmap(rules: dict[str, str]) -> str:
    """The base64 precompiled_charsmap a tokenizer.json's Precompiled normalizer holds, for ``rules``."""
    import base64

    from sentencepiece import sentencepiece_model_pb2

    model = sentencepiece_model_pb2.ModelProto()
    model.ParseFromString(_sentencepiece_model(rules))
    return base64.b64encode(model.normalizer_spec.precompiled_charsmap).decode()


def _xlmr_normalizer(c: Ctx, normalizer: dict) -> Path:
    folder = _xlmr(c)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["normalizer"] = normalizer
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def _xlmr_unk_free(c: Ctx) -> Path:
    folder = _xlmr(c)
    data = json.loads((folder / "tokenizer.json").read_text())
    data["model"]["unk_id"] = None
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def _bad_trie_size(charsmap: bytes, size: int) -> bytes:
    return size.to_bytes(4, "little") + charsmap[4:]


def _xlmr_sentencepiece(c: Ctx, edit) -> Path:
    """A tiny XLM-R folder whose tokenizer is a sentencepiece.bpe.model (no tokenizer.json): a real one trained on the
    built-in corpus, through ``edit(bytes) -> bytes``."""
    folder = _xlmr(c)
    (folder / "tokenizer.json").unlink()
    (folder / "sentencepiece.bpe.model").write_bytes(edit(_sentencepiece_model()))
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": "XLMRobertaTokenizer"}))
    return folder


def _with_charsmap_size(size: int):
    def edit(data: bytes) -> bytes:
        from sentencepiece import sentencepiece_model_pb2

        model = sentencepiece_model_pb2.ModelProto()
        model.ParseFromString(data)
        model.normalizer_spec.precompiled_charsmap = _bad_trie_size(model.normalizer_spec.precompiled_charsmap, size)
        return model.SerializeToString()
    return edit


def _tokenizer_edit(c: Ctx, edit) -> Path:
    """The tiny BERT folder whose tokenizer.json went through ``edit(data)`` (in place)."""
    def apply(data):
        edit(data)
        return data
    return _hf_edited(c, "tokenizer.json", apply)


def _sparse_id(data):
    vocab = data["model"]["vocab"]
    vocab[sorted(vocab, key=vocab.get)[-1]] = 5000  # as many tokens as rows, one of them numbered past the table


def _growing_chain(data):
    # a Replace of growth 1 (a letter by U+FDFA) before each NFKC step, which makes U+FDFA 18 characters
    steps = [{"type": "Replace", "pattern": {"String": "a"}, "content": "\u0644"}]
    for _ in range(6):
        steps += [{"type": "Replace", "pattern": {"String": "\u0644"}, "content": "\ufdfa"}, {"type": "NFKC"}]
    data["normalizer"] = {"type": "Sequence", "normalizers": steps}


def _classifier_config(**values):
    """An edit making config.json a sequence classifier's, with ``values`` set."""
    def edit(m):
        return {**m, "architectures": ["BertForSequenceClassification"], **values}
    return edit


def _set_in(path: tuple, value):
    """An edit setting the value at ``path`` (keys and list indices) of a manifest."""
    def edit(m):
        inner = m
        for key in path[:-1]:
            inner = inner[key]
        inner[path[-1]] = value
        return m
    return edit


# -- the corpus: (id, setup) ------------------------------------------------------------------------------------
CASES = {
    # ONNX from other exporters (sentence-transformers' onnx/ and openvino/ folders, Optimum)
    "export: ONNX whose Dense weights are a pickle": lambda c: (
        ["export", _dense_as_bin(c) / "onnx" / "model.onnx", "--out", c.tmp / "o"],
        "keeps its Dense weights in pytorch_model.bin (a pickle)", [c.tmp / "o"]),
    "export: ONNX beside an unsupported sentence-transformers module": lambda c: (
        ["export", _with_module(c, "sentence_transformers.models.LSTM") / "onnx" / "model.onnx", "--out",
         c.tmp / "o"], "sentence_transformers.models.LSTM is not supported", [c.tmp / "o"]),
    "export: sentence-transformers' OpenVINO export": lambda c: (
        ["export", _openvino_export(c) / "openvino" / "openvino_model.xml", "--out", c.tmp / "o"],
        "is an OpenVINO IR (an OpenVINO export); bertopt artifacts hold ONNX", [c.tmp / "o"]),
    "export: folder with only an ONNX export": lambda c: (
        ["export", c.st_onnx_folder(), "--out", c.tmp / "o"], "holds an ONNX export but no PyTorch weights; give "
         "the ONNX file itself", [c.tmp / "o"]),
    "export --pooling on an ONNX that pools already": lambda c: (
        ["export", c.st_onnx_folder(token_states_only=False) / "onnx" / "model.onnx", "--pooling", "cls", "--out",
         c.tmp / "o"], "so there is nothing to pool; drop --pooling cls", [c.tmp / "o"]),
    # numeric options out of bounds (each parameter declares its bounds once)
    "export --max-seq-len -5": lambda c: (
        ["export", c.tiny_hf, "--max-seq-len", "-5", "--out", c.tmp / "o"], "'max_seq_len' must be at least 1",
        [c.tmp / "o"]),
    "export --max-seq-len 0": lambda c: (
        ["export", c.tiny_hf, "--max-seq-len", "0", "--out", c.tmp / "o"], "'max_seq_len' must be at least 1",
        [c.tmp / "o"]),
    "export --opset 9": lambda c: (
        ["export", c.tiny_hf, "--opset", "9", "--out", c.tmp / "o"], "'opset' must be between 17 and 21",
        [c.tmp / "o"]),
    "export --check-tolerance -1": lambda c: (
        ["export", c.tiny_hf, "--check-tolerance", "-1", "--out", c.tmp / "o"], "'check_tolerance' must be at least 0",
        [c.tmp / "o"]),
    "quantize --calibration-size 0": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--calibration-size", "0", "--out", c.tmp / "o"],
        "'calibration_size' must be at least 1", [c.tmp / "o"]),
    "quantize --smooth-alpha 2": lambda c: (
        ["quantize", c.tiny, "--smooth-alpha", "2", "--out", c.tmp / "o"], "'smooth_alpha' must be between 0 and 1",
        [c.tmp / "o"]),
    "quantize --smooth-alpha nan": lambda c: (
        ["quantize", c.tiny, "--smooth-alpha", "nan", "--out", c.tmp / "o"], "'smooth_alpha' must be a number",
        [c.tmp / "o"]),
    "quantize --activation-group-size -1": lambda c: (
        ["quantize", c.tiny, "--runtime", "openvino", "--activation-group-size", "-1", "--out", c.tmp / "o"],
        "'activation_group_size' must be at least 0", [c.tmp / "o"]),
    # an option of another quantize method is refused by the declaration: the option, its method, the fix
    "quantize --mode int8-dynamic --calibration-method entropy": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-dynamic", "--calibration-method", "entropy", "--out", c.tmp / "o"],
        "--calibration-method entropy applies to --mode int8-static only (ONNX Runtime static int8), not to "
        "--mode int8-dynamic (ONNX Runtime dynamic int8); drop --calibration-method", [c.tmp / "o"]),
    "quantize --mode int8-static --per-token": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--per-token", "--out", c.tmp / "o"],
        "--per-token applies to --mode int8-dynamic only (ONNX Runtime dynamic int8), not to --mode int8-static "
        "(ONNX Runtime static int8); drop --per-token", [c.tmp / "o"]),
    "quantize --runtime openvino --smooth-alpha 0.5": lambda c: (
        ["quantize", c.tiny, "--runtime", "openvino", "--smooth-alpha", "0.5", "--out", c.tmp / "o"],
        "--smooth-alpha 0.5 applies to --mode int8-dynamic or --mode int8-static or --mode int8-static --runtime "
        "openvino only (ONNX Runtime dynamic int8, ONNX Runtime static int8, OpenVINO static int8 (NNCF)), not to "
        "--mode int8-dynamic --runtime openvino (OpenVINO int8); drop --smooth-alpha", [c.tmp / "o"]),
    "quantize --mode fp16 --activation-group-size 8": lambda c: (
        ["quantize", c.tiny, "--mode", "fp16", "--activation-group-size", "8", "--out", c.tmp / "o"],
        "--activation-group-size 8 applies to --mode int8-dynamic --runtime openvino only (OpenVINO int8), not to "
        "--mode fp16 (fp16 conversion); drop --activation-group-size", [c.tmp / "o"]),
    "quantize --mode int8-dynamic --keep-fp32-ops Softmax": lambda c: (
        ["quantize", c.tiny, "--keep-fp32-ops", "Softmax", "--out", c.tmp / "o"],
        "--keep-fp32-ops Softmax applies to --mode fp16 only (fp16 conversion), not to --mode int8-dynamic (ONNX "
        "Runtime dynamic int8); drop --keep-fp32-ops", [c.tmp / "o"]),
    # an option the picked method reads only with another: given without it, it would change nothing
    "quantize --float-short-texts not a number": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--runtime", "openvino", "--float-short-texts", "short",
         "--out", c.tmp / "o"], "must be auto, off or a number of tokens (1 or more)", [c.tmp / "o"]),
    "quantize --float-short-texts past the model's window": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--runtime", "openvino", "--float-short-texts", "4096",
         "--out", c.tmp / "o"], "would run on the float copy, none int8; give fewer tokens, or off", [c.tmp / "o"]),
    "quantize --float-short-texts with dynamic int8": lambda c: (
        ["quantize", c.tiny, "--float-short-texts", "8", "--out", c.tmp / "o"],
        "--float-short-texts 8 applies to --mode int8-static --runtime openvino only", [c.tmp / "o"]),
    # NNCF's static int8 runs its own ranked search, not the grouped one --accuracy-group steers
    "quantize nncf static int8 --accuracy-group": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--runtime", "openvino", "--accuracy-target", "cos_min=0.99",
         "--accuracy-group", "1", "--out", c.tmp / "o"],
        "--accuracy-group 1 applies to --mode fp16 or --mode int8-dynamic or --mode int8-static or --mode "
        "int8-dynamic --runtime openvino only", [c.tmp / "o"]),
    "quantize --smooth-roles without --smooth-alpha": lambda c: (
        ["quantize", c.tiny, "--smooth-roles", "ffn-out", "--out", c.tmp / "o"],
        "--smooth-roles ffn-out would be ignored: --mode int8-dynamic (ONNX Runtime dynamic int8) reads it only with "
        "--smooth-alpha; add --smooth-alpha or drop --smooth-roles", [c.tmp / "o"]),
    "quantize --mode int8-dynamic --calibration-data (nothing calibrates)": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-dynamic", "--calibration-data", c.write("calib.txt", "a sentence\n"),
         "--out", c.tmp / "o"],
        "would be ignored: --mode int8-dynamic (ONNX Runtime dynamic int8) reads it only with --accuracy-target, "
        "--weight-rounding gptq, --smooth-alpha, --first-token-fp32 or --per-token, unlike --mode int8-static; add "
        "one of them or drop --calibration-data", [c.tmp / "o"]),
    "quantize --mode fp16 --keep-fp32-ops of a type the graph has not": lambda c: (
        ["quantize", c.tiny, "--mode", "fp16", "--keep-fp32-ops", "softmax", "--out", c.tmp / "o"],
        "has no operator of that type (did you mean Softmax?), so it would keep nothing fp32; name operator types "
        "of this graph", [c.tmp / "o"]),
    "run: a fp16 quantize step with --op-types but no accuracy target": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages:\n  - export: {{}}\n  - quantize: {{mode: fp16, "
                         "op_types: [MatMul]}\n"), "--out", c.tmp / "a"],
        "stages[1] quantize: --op-types MatMul would be ignored: --mode fp16 (fp16 conversion) reads it only with "
        "--accuracy-target, unlike --mode int8-dynamic or --mode int8-static", [c.tmp / "a"]),
    "quantize --mode fp16 --runtime openvino": lambda c: (
        ["quantize", c.tiny, "--mode", "fp16", "--runtime", "openvino", "--out", c.tmp / "o"],
        "--runtime openvino quantises with --mode int8-dynamic or --mode int8-static, not --mode fp16; use --runtime "
        "onnxruntime for "
        "--mode fp16", [c.tmp / "o"]),
    "run: a quantize step with another method's option": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages:\n  - export: {{}}\n  - quantize: {{mode: fp16, "
                         "weight_rounding: gptq}\n"), "--out", c.tmp / "a"],
        "stages[1] quantize: --weight-rounding gptq applies to --mode int8-dynamic or --mode int8-dynamic --runtime "
        "openvino only", [c.tmp / "a"]),
    "compile --min-cosine 1.5": lambda c: (
        ["compile", c.tiny, "--min-cosine", "1.5", "--out", c.tmp / "o"], "'min_cosine' must be between 0 and 1",
        [c.tmp / "o"]),
    "optimize --opt-level 5": lambda c: (
        ["optimize", c.tiny, "--opt-level", "5", "--out", c.tmp / "o"], "'opt_level' must be 0, 1, 2 or 99",
        [c.tmp / "o"]),
    "validate --repeats 0": lambda c: (
        ["validate", c.tiny, "--repeats", "0", "--report-dir", c.tmp / "r"], "'repeats' must be at least 1",
        [c.tmp / "r"]),
    "validate --max-texts 0": lambda c: (
        ["validate", c.tiny, "--max-texts", "0", "--report-dir", c.tmp / "r"], "'max_texts' must be at least 1",
        [c.tmp / "r"]),
    "validate --atol -1": lambda c: (
        ["validate", c.tiny, "--atol", "-1", "--report-dir", c.tmp / "r"], "'atol' must be at least 0",
        [c.tmp / "r"]),
    "validate --error-quantile 1.5": lambda c: (
        ["validate", c.tiny, "--error-quantile", "1.5", "--report-dir", c.tmp / "r"], "'error_quantile' must be",
        [c.tmp / "r"]),
    "validate --threads 0": lambda c: (
        ["validate", c.tiny, "--threads", "0", "--report-dir", c.tmp / "r"],
        "'threads' must be between 1 and 1024, got 0", [c.tmp / "r"]),
    "serve --port 0": lambda c: (["serve", c.tiny, "--port", "0"], "serve: 'port' must be between 1 and 65535", []),
    "serve --http-port the same as --port": lambda c: (
        ["serve", c.tiny, "--port", "5555", "--port-out", "5556", "--http-port", "5555"],
        "--http-port 5555 is also the ZeroMQ --port; give each its own port", []),
    "serve --bind an address of no interface here": lambda c: (
        ["serve", c.tiny, "--bind", "999.1.1.1", "--port", "5555", "--port-out", "5556", "--num-worker", "1"],
        "cannot listen on --bind '999.1.1.1'", []),
    "serve --device-map of no numbers": lambda c: (
        ["serve", c.tiny, "--device-map", ",,"], "is not a list of GPU numbers (0 or more)", []),
    "serve --device-map negative": lambda c: (
        ["serve", c.tiny, "--device-map", "-1"], "is not a list of GPU numbers (0 or more)", []),
    # secret keys beside other files end up shipped with them (here: inside an artifact)
    "serve --make-curve-keys under a file": lambda c: (
        ["serve", "--make-curve-keys", c.ensure_file("plain.txt") / "keys"], "is a file", []),
    "serve --make-curve-keys into an artifact": lambda c: (
        ["serve", "--make-curve-keys", c.copy_artifact()], "is not an empty folder; secret keys go in a folder of "
        "their own", [c.tmp / "art" / "server.key_secret", c.tmp / "art" / "authorized"]),
    "client status --ip with a space": lambda c: (
        ["client", "status", "--ip", "bad host"], "cannot address a server at 'bad host'", []),
    "kafka --group-id empty": lambda c: (
        ["kafka", c.tiny, "--bootstrap", "127.0.0.1:9", "--request-topic", "a", "--response-topic", "b",
         "--group-id", ""], "kafka: 'group_id' is empty; give a consumer group name", []),
    # librdkafka ends the process with a C assertion (exit 134) on an empty group id
    "kafka -X group.id= (empty)": lambda c: (
        ["kafka", c.tiny, "--bootstrap", "127.0.0.1:9", "--request-topic", "a", "--response-topic", "b",
         "-X", "group.id=", "--connect-timeout", "1"], "the consumer's group.id is empty (from -X)", []),
    "spark-predict --master malformed": lambda c: (
        ["spark-predict", c.tiny, "--input", c.parquet("in.parquet"), "--output", c.tmp / "o", "--master", "x://"],
        "--master 'x://' is not a Spark master; give local[N]", [c.tmp / "o"]),
    "inspect a path with an emoji code": lambda c: (
        ["inspect", c.tmp / ":fire:" / "x"], ":fire:/x", []),
    "serve --num-worker 0": lambda c: (
        ["serve", c.tiny, "--num-worker", "0"], "serve: 'num_worker' must be between 1 and 256", []),
    "serve --device-map with --provider cpu": lambda c: (
        ["serve", c.tiny, "--device-map", "0", "--provider", "cpu", "--no-warmup"],
        "--device-map places the workers on GPUs, but --provider cpu keeps them on the CPU", []),
    "serve --max-seq-len 0": lambda c: (
        ["serve", c.tiny, "--max-seq-len", "0"], "serve: 'max_seq_len' must be at least 1", []),
    "client encode --timeout -1": lambda c: (
        ["client", "encode", "hello", "--port", str(free_port()), "--timeout", "-1"],
        "client encode: 'timeout' must be at least 0.001", []),
    "client status --timeout 0": lambda c: (
        ["client", "status", "--port", str(free_port()), "--timeout", "0"],
        "client status: 'timeout' must be at least 0.001", []),
    # client encode --out is checked before the server is asked (none runs here: a missed check is "no reply")
    "client encode --out without .npy": lambda c: (
        ["client", "encode", "hi", "--port", str(free_port()), "--timeout", "1", "--out", c.tmp / "vectors"],
        "give the path of a .npy file", [c.tmp / "vectors", c.tmp / "vectors.npy"]),
    "client encode --out inside an artifact": lambda c: (
        ["client", "encode", "hi", "--port", str(free_port()), "--timeout", "1", "--out", c.tiny / "x.npy"],
        f"is inside the artifact {c.tiny}", [c.tiny / "x.npy"]),
    "client encode --out under a file": lambda c: (
        ["client", "encode", "hi", "--port", str(free_port()), "--timeout", "1", "--out",
         c.ensure_file("plain.txt") / "x.npy"], "is a file", []),
    "client encode --out an existing file": lambda c: (
        ["client", "encode", "hi", "--port", str(free_port()), "--timeout", "1", "--out", c.write("old.npy", "x")],
        "old.npy is an existing file; choose a new file name", []),
    "kafka --port 70000": lambda c: (
        ["kafka", c.tiny, "--bootstrap", "127.0.0.1:9", "--request-topic", "a", "--response-topic", "b",
         "--backend", "zmq", "--port", "70000"], "kafka: 'port' must be between 1 and 65535", []),
    "spark-predict --batch-size 0": lambda c: (
        ["spark-predict", c.tiny, "--input", c.tmp / "in.txt", "--output", c.tmp / "o",
         "--batch-size", "0"], "spark-predict: 'batch_size' must be between 1 and 4096", [c.tmp / "o"]),
    # outputs that cannot be written: checked before any work
    "export --out unwritable": lambda c: (
        ["export", c.tiny_hf, "--out", UNWRITABLE + "/o"], "is not writable", []),
    "quantize --out under a file": lambda c: (
        ["quantize", c.tiny, "--out", c.ensure_file("plain.txt") / "o"], "is a file", []),
    "validate --report-dir unwritable": lambda c: (
        ["validate", c.tiny, "--report-dir", UNWRITABLE + "/r"], "is not writable", []),
    "run --out unwritable": lambda c: (
        ["run", c.recipe("model: " + str(c.tiny_hf) + "\nstages: [export]\n"), "--out", UNWRITABLE], "is not writable",
        []),
    # manifests checked against a schema on load (inspect, validate, serve)
    "inspect: outputs of the wrong type": lambda c: (
        ["inspect", c.edited_manifest(_set("outputs", "sentence_embedding"))], "'outputs' must be a list", []),
    "inspect: outputs missing": lambda c: (
        ["inspect", c.edited_manifest(_drop("outputs"))], "'outputs' is missing", []),
    "inspect: manifest is a list": lambda c: (
        ["inspect", c.edited_manifest(lambda m: [m])], "must be a JSON object", []),
    "validate: inputs missing": lambda c: (
        ["validate", c.edited_manifest(_drop("inputs")), "--report-dir", c.tmp / "r"], "'inputs' is missing",
        [c.tmp / "r"]),
    "validate: an output without a name": lambda c: (
        ["validate", c.edited_manifest(_set("outputs", [{"kind": "embedding"}])), "--report-dir", c.tmp / "r"],
        "outputs[0] must be a mapping with a string 'name'", [c.tmp / "r"]),
    "serve: files of the wrong type": lambda c: (
        ["serve", c.edited_manifest(_set("files", ["model.onnx"])), "--port", str(free_port()), "--port-out",
         str(free_port())], "'files' must be a mapping", []),
    "serve: model section of the wrong type": lambda c: (
        ["serve", c.edited_manifest(_set("model", "bert")), "--port", str(free_port()), "--port-out",
         str(free_port())], "'model' must be a mapping", []),
    # what a manifest says the model is: a task, a precision and a primary output bertopt knows (inspect and prune
    # took them as written: prune even renamed the primary output to its last)
    "inspect: a manifest task bertopt does not know": lambda c: (
        ["inspect", c.edited_manifest(_set_in(("model", "task"), "summarization"))],
        "'model.task' is 'summarization', not a task bertopt knows (embedding, classification, token-classification, "
        "rerank, sparse-embedding); re-create the artifact", []),
    "prune: a manifest precision bertopt does not write": lambda c: (
        ["prune", c.edited_manifest(_set("precision", "int4")), "--out", c.tmp / "o"],
        "'precision' is 'int4', not one bertopt writes (fp32, fp16, int8-dynamic, int8-static, auto, bf16, or an int8 "
        "one with its OpenVINO execution precision: int8-dynamic+bf16); re-create the artifact", [c.tmp / "o"]),
    "inspect: a primary output that is not an output": lambda c: (
        ["inspect", c.edited_manifest(_set_in(("model", "primary_output"), "pooler_output"))],
        "primary output 'pooler_output' is not among the outputs (last_hidden_state, sentence_embedding); re-create "
        "the artifact", []),
    "prune: a primary output that is not an output": lambda c: (
        ["prune", c.edited_manifest(_set_in(("model", "primary_output"), "pooler_output")), "--out", c.tmp / "o"],
        "primary output 'pooler_output' is not among the outputs", [c.tmp / "o"]),
    # data with no real text, and data files that are not there
    "validate --data of NUL bytes": lambda c: (
        ["validate", c.tiny, "--data", c.nul_file(), "--report-dir", c.tmp / "r"], "no real text", [c.tmp / "r"]),
    "validate --data NUL bytes in a CSV column": lambda c: (
        ["validate", c.tiny, "--data", c.write("nul.csv", "text\n\x00\x00\n\x00\n"), "--report-dir", c.tmp / "r"],
        "no real text", [c.tmp / "r"]),
    "validate --data missing": lambda c: (
        ["validate", c.tiny, "--data", c.tmp / "nope.jsonl", "--report-dir", c.tmp / "r"], "data file not found",
        [c.tmp / "r"]),
    "quantize --calibration-data of NUL bytes": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--calibration-data", c.nul_file(), "--out", c.tmp / "o"],
        "no real text", [c.tmp / "o"]),
    "quantize --calibration-data without a text column": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--calibration-data", c.write("c.jsonl", '{"x": "hi"}\n'),
         "--out", c.tmp / "o"], "has no column 'text' (columns: x); give each row a 'text' column, or use a .txt "
        "file with one text a line", [c.tmp / "o"]),
    "quantize --calibration-data missing": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--calibration-data", c.tmp / "nope.txt", "--out",
         c.tmp / "o"], "not found", [c.tmp / "o"]),
    # targets that name no metric
    "validate --targets cosine_minimum=0.9": lambda c: (
        ["validate", c.tiny, "--targets", "cosine_minimum=0.9", "--report-dir", c.tmp / "r"],
        "known metrics: cos_mean", [c.tmp / "r"]),
    "validate --targets cosine_minimum>=0.9": lambda c: (
        ["validate", c.tiny, "--targets", "cosine_minimum>=0.9", "--report-dir", c.tmp / "r"],
        "unknown metric 'cosine_minimum'", [c.tmp / "r"]),
    "validate --targets batch_dev without the batch check": lambda c: (
        ["validate", c.tiny, "--targets", "batch_dev<=1e-4", "--no-batch-check", "--report-dir", c.tmp / "r"],
        "needs the batch-invariance check", [c.tmp / "r"]),
    "validate --targets cos_min=high": lambda c: (
        ["validate", c.tiny, "--targets", "cos_min=high", "--report-dir", c.tmp / "r"], "cannot read target",
        [c.tmp / "r"]),
    # a recipe is checked whole before its first stage writes anything
    "run: second stage names a missing calibration file": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages:\n  - export: {{}}\n  - quantize: {{mode: int8-static, "
                         f"calibration_data: {c.tmp / 'missing.txt'}}}\n"), "--out", c.tmp / "a"],
        "'calibration_data' file", [c.tmp / "a"]),
    "run: second stage's calibration file is NUL bytes": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages:\n  - export: {{}}\n  - quantize: {{mode: int8-static, "
                         f"calibration_data: {c.nul_file()}}}\n"), "--out", c.tmp / "a"], "no real text",
        [c.tmp / "a"]),
    "run: validate data missing": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages: [export]\nvalidate: {{data: {c.tmp / 'gone.txt'}}}\n"),
         "--out", c.tmp / "a"], "'data' file", [c.tmp / "a"]),
    "run: a stage parameter out of bounds": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nstages:\n  - export: {{max_seq_len: 0}}\n"), "--out", c.tmp / "a"],
        "'max_seq_len' must be at least 1", [c.tmp / "a"]),
    # spark-predict: input and column checked before Spark starts
    "spark-predict: input missing": lambda c: (
        ["spark-predict", c.tiny, "--input", c.tmp / "nope.parquet", "--output", c.tmp / "o"],
        "does not exist", [c.tmp / "o"]),
    "spark-predict: CSV without the text column": lambda c: (
        ["spark-predict", c.tiny, "--input", c.write("in.csv", "body\nhello\n"), "--output",
         c.tmp / "o"], "has no column 'text'", [c.tmp / "o"]),
    "spark-predict: Parquet without the pair column": lambda c: (
        ["spark-predict", c.tiny, "--input", c.parquet("in.parquet"), "--output", c.tmp / "o",
         "--pair-col", "second"], "has no column 'second'", [c.tmp / "o"]),
    # said before Spark starts (after it, the line came at 150-160 of Spark's 200 lines of Java and Python traces)
    "spark-predict: an empty text input": lambda c: (
        ["spark-predict", c.tiny, "--input", c.write("in.txt", ""), "--output", c.tmp / "o"],
        "in.txt has no text (empty or blank); write one input a line", [c.tmp / "o"]),
    "spark-predict: a blank text input": lambda c: (
        ["spark-predict", c.tiny, "--input", c.write("in.txt", "\n  \n\t\n"), "--output", c.tmp / "o"],
        "has no text (empty or blank)", [c.tmp / "o"]),
    "spark-predict: random bytes as a text input": lambda c: (
        ["spark-predict", c.tiny, "--input", c.nul_file("in.txt"), "--output", c.tmp / "o"],
        "in.txt is not UTF-8 text", [c.tmp / "o"]),
    "spark-predict: a FIFO as input": lambda c: (
        ["spark-predict", c.tiny, "--input", c.fifo("in.txt"), "--output", c.tmp / "o"],
        "is not a regular file (a FIFO, device or socket)", [c.tmp / "o"]),
    "spark-predict --max-seq-len past the positions": lambda c: (
        ["spark-predict", c.tiny, "--input", c.write("in.txt", "hello\n"), "--output", c.tmp / "o",
         "--max-seq-len", "100000"], "max sequence length 100000 exceeds the model's", [c.tmp / "o"]),
    # kafka: an unreachable broker is one line after a bounded wait, not librdkafka's log
    "kafka: unreachable broker": lambda c: (
        ["kafka", c.tiny, "--bootstrap", f"127.0.0.1:{free_port()}", "--request-topic", "a", "--response-topic",
         "b", "--connect-timeout", "1.5"], "cannot reach Kafka", []),
    "kafka --connect-timeout 0": lambda c: (
        ["kafka", c.tiny, "--bootstrap", "127.0.0.1:9", "--request-topic", "a", "--response-topic", "b",
         "--connect-timeout", "0"], "kafka: 'connect_timeout' must be at least 0.001", []),
    # the output-path policy (bertopt.output_paths): real paths, never the input, --force only over bertopt's own
    "quantize --out INPUT/tokenizer/.. --force": lambda c: (
        ["quantize", c.copy_artifact(), "--out", c.tmp / "art" / "tokenizer" / "..", "--force"], "is the input",
        []),
    "quantize --out inside the input": lambda c: (
        ["quantize", c.copy_artifact(), "--out", c.tmp / "art" / "q"], "is inside the input", [c.tmp / "art" / "q"]),
    "quantize --out inside the input reached through a symlinked parent": lambda c: (
        ["quantize", _linked_artifact(c), "--out", c.tmp / "real" / "art" / "q"], "is inside the input",
        [c.tmp / "real" / "art" / "q"]),
    "quantize --out the folder holding the input --force": lambda c: (
        ["quantize", c.copy_artifact(), "--out", c.tmp, "--force"], "holds the input", []),
    "quantize --out an existing file --force": lambda c: (
        ["quantize", c.tiny, "--out", c.ensure_file("o"), "--force"], "is an existing file, not a bertopt artifact",
        []),
    "quantize --out a folder of user files --force": lambda c: (
        ["quantize", c.tiny, "--out", _user_folder(c, "mine"), "--force"],
        "exists and is not a bertopt artifact (it holds other files)", []),
    "quantize --out a validation report --force": lambda c: (
        ["quantize", c.tiny, "--out", _report_folder(c), "--force"], "exists and is not a bertopt artifact", []),
    "quantize: the input artifact holds a symlink to a file outside it": lambda c: (
        ["quantize", _artifact_with_outside_link(c), "--out", c.tmp / "o"], "is a symbolic link",
        [c.tmp / "o"]),
    "export --check-tolerance inf": lambda c: (
        ["export", c.tiny_hf, "--check-tolerance", "inf", "--out", c.tmp / "o"],
        "'check_tolerance' must be a finite number", [c.tmp / "o"]),
    "export --check-tolerance nan": lambda c: (
        ["export", c.tiny_hf, "--check-tolerance", "nan", "--out", c.tmp / "o"], "'check_tolerance' must be a number",
        [c.tmp / "o"]),
    "validate --report-dir inside the artifact": lambda c: (
        ["validate", c.copy_artifact(), "--report-dir", c.tmp / "art" / "r"], "is inside the input",
        [c.tmp / "art" / "r"]),
    "validate --report-dir the artifact itself": lambda c: (
        ["validate", c.copy_artifact(), "--report-dir", c.tmp / "art"], "is the input", []),
    "validate --report-dir a folder of user files": lambda c: (
        ["validate", c.tiny, "--report-dir", _user_folder(c, "mine")],
        "exists and is not a bertopt validation report", []),
    "spark-predict --output the artifact --force": lambda c: (
        ["spark-predict", c.copy_artifact(), "--input", c.parquet("in.parquet"), "--output",
         c.tmp / "art", "--force"], "is the input", []),
    "spark-predict --output the input --force": lambda c: (
        ["spark-predict", c.tiny, "--input", c.parquet("in.parquet"), "--output", c.tmp / "in.parquet",
         "--force"], "is the input", []),
    "spark-predict --output a folder of user files --force": lambda c: (
        ["spark-predict", c.tiny, "--input", c.parquet("in.parquet"), "--output",
         _user_folder(c, "mine"), "--force"], "exists and is not a bertopt spark-predict output", []),
    "spark-predict --output a folder holding the input --force": lambda c: (
        ["spark-predict", c.tiny, "--input", c.parquet("in.parquet"), "--output", c.tmp, "--force"],
        "holds the input", []),
    "bench --json a folder": lambda c: (
        ["bench", c.tiny, "--json", _user_folder(c, "results")], "is a folder; give the path of a .json file", []),
    "bench --json a file that is no bench result": lambda c: (
        ["bench", c.tiny, "--json", c.write("notes.json", "my notes\n")], "exists and is not a bertopt JSON result",
        []),
    "bench --json inside the artifact": lambda c: (
        ["bench", c.copy_artifact(), "--json", c.tmp / "art" / "bench.json"], "is inside the input",
        [c.tmp / "art" / "bench.json"]),
    # recipes: plain names, every output folder checked before the first stage, bounded YAML
    "run: recipe name ../x": lambda c: (
        ["run", c.recipe(f"name: ../x\nmodel: {c.tiny_hf}\nstages: [export]\n"), "--out", c.tmp / "a"],
        "must be a plain name", [c.tmp / "a", c.tmp / "x"]),
    "run: recipe name is an absolute path": lambda c: (
        ["run", c.recipe(f"name: {c.tmp / 'abs'}\nmodel: {c.tiny_hf}\nstages: [export]\n"), "--out", c.tmp / "a"],
        "must be a plain name", [c.tmp / "a", c.tmp / "abs"]),
    "run: a later stage folder holds user files": lambda c: (
        ["run", *_recipe_with_later_stage_folder_of_user_files(c)[:1], "--out", c.tmp / "a"],
        "02-quantize exists and is not a bertopt artifact (it holds other files)", [c.tmp / "a" / "r" / "01-export"]),
    "run: recipe out: inside the model": lambda c: (
        ["run", c.recipe(f"name: r\nmodel: {_hf_copy(c)}\nout: {c.tmp / 'hf' / 'artifacts'}\nstages: [export]\n")],
        "is inside the input", [c.tmp / "hf" / "artifacts"]),
    "run: recipe out: is not a path": lambda c: (
        ["run", c.recipe(f"model: {c.tiny_hf}\nout: [a, b]\nstages: [export]\n")], "'out' must be a folder path",
        []),
    # a model folder's JSON files with values transformers would fail on deep inside (config sizes, pipeline files)
    "export: config.json is a list": lambda c: (
        ["export", _hf_edited(c, "config.json", lambda m: [m]), "--out", c.tmp / "a"],
        "config.json holds a JSON list, not an object", [c.tmp / "a"]),
    "export: config.json negative positions": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("max_position_embeddings", -1)), "--out", c.tmp / "a"],
        "'max_position_embeddings' must be a positive whole number, got -1", [c.tmp / "a"]),
    "export: config.json zero attention heads": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("num_attention_heads", 0)), "--out", c.tmp / "a"],
        "'num_attention_heads' must be a positive whole number, got 0", [c.tmp / "a"]),
    "export: config.json hidden size a string": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("hidden_size", "x")), "--out", c.tmp / "a"],
        "'hidden_size' must be a positive whole number, got 'x'", [c.tmp / "a"]),
    "export: config.json heads that do not divide the width": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("hidden_size", 30)), "--out", c.tmp / "a"],
        "cannot load the model in", [c.tmp / "a"]),
    "export: config.json id2label a list": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("id2label", [1, 2])), "--out", c.tmp / "a"],
        "'id2label' must be an object", [c.tmp / "a"]),
    "export: config.json num_labels 10^10 (a 6.6 GB label map)": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(num_labels=10**10, id2label={})), "--out",
         c.tmp / "a"], "'num_labels' must be a whole number from 1 to 65,536, got 10000000000", [c.tmp / "a"]),
    "export: config.json num_labels a string": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(num_labels="abc", id2label={})), "--out",
         c.tmp / "a"], "'num_labels' must be a whole number from 1 to 65,536, got 'abc'", [c.tmp / "a"]),
    "export: config.json id2label keyed by names": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(id2label={"neg": "NEGATIVE", "pos": "POSITIVE"})),
         "--out", c.tmp / "a"], "'id2label' key 'neg' is not a label index from 0 to 1", [c.tmp / "a"]),
    "export: config.json id2label naming a label by a number": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(id2label={"0": "NEGATIVE", "1": 7})),
         "--out", c.tmp / "a"], "'id2label' names label 1 7, not a name of 1 to 200 characters", [c.tmp / "a"]),
    "export: a pooling config naming mean 5,000 times (minutes, a 160,000-wide embedding)": lambda c: (
        ["export", _hf_edited(c, "1_Pooling/config.json", lambda m: {"pooling_mode": ["mean"] * 5000}), "--out",
         c.tmp / "a"], "pooling_mode lists a mode more than once (5,000 modes); name each of", [c.tmp / "a"]),
    "export: a Dense config declaring 30000 x 30000 (3.6 GB allocated, then a traceback)": lambda c: (
        ["export", _hf_with_dense(c, {"in_features": 30000, "out_features": 30000}), "--out", c.tmp / "a"],
        "the Dense weights hold bias [8], weight [8, 32], not those its config.json declares (weight [30000, 30000]",
        [c.tmp / "a"]),
    "export: a Dense whose in_features is a string": lambda c: (
        ["export", _hf_with_dense(c, {"in_features": "32", "out_features": 8}), "--out", c.tmp / "a"],
        "'in_features' must be a whole number from 1 to 65,536, got '32'; re-save the Dense module", [c.tmp / "a"]),
    "export: a Dense wider than the pooled vector before it": lambda c: (
        ["export", _hf_with_dense(c, {"in_features": 64, "out_features": 8}, shape=(8, 64)), "--out", c.tmp / "a"],
        "'in_features' is 64, but the module before it outputs 32 values", [c.tmp / "a"]),
    "export: Dense weights a pickle that runs code (not run; was a traceback)": lambda c: (
        ["export", _hf_with_dense(c, {"in_features": 32, "out_features": 8}, shape=None, pickle_payload=True),
         "--out", c.tmp / "a"], "pytorch_model.bin holds more than plain tensors (a pickle bertopt never runs)",
        [c.tmp / "a", c.tmp / "PWNED"]),
    "export: config.json architectures a number (a traceback)": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("architectures", [5])), "--out", c.tmp / "a"],
        "'architectures' must be a list of class names (e.g. [\"BertModel\"]), got [5]", [c.tmp / "a"]),
    "export: a cross-encoder config whose sentence_transformers is a string": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(id2label={"0": "score"}, sentence_transformers="x")),
         "--out", c.tmp / "a"], "'sentence_transformers' must be an object, got 'x'", [c.tmp / "a"]),
    "export: a cross-encoder config whose activation is a number": lambda c: (
        ["export", _hf_edited(c, "config.json", _classifier_config(id2label={"0": "score"},
                                                                    sbert_ce_default_activation_function=5)),
         "--out", c.tmp / "a"], "a cross-encoder's activation must be a class name", [c.tmp / "a"]),
    "export: a pooling mode that is a number": lambda c: (
        ["export", _hf_edited(c, "1_Pooling/config.json", lambda m: {"pooling_mode": 5}), "--out", c.tmp / "a"],
        "unsupported sentence-transformers pooling {'pooling_mode': 5}", [c.tmp / "a"]),
    "export: modules.json naming a module type by a number": lambda c: (
        ["export", _hf_edited(c, "modules.json", lambda m: [{**m[0], "type": 5}, *m[1:]]), "--out", c.tmp / "a"],
        "a module's 'type' must be a class name", [c.tmp / "a"]),
    "export: vocab_size 20,000,000 and no embeddings (a 2.5 GB artifact of random numbers, exit 0)": lambda c: (
        ["export", _hf_weights_without(c, "word_embeddings", vocab_size=20_000_000), "--out", c.tmp / "a"],
        "config.json describes a model of 640,", [c.tmp / "a"]),
    "export: weights without one bias (a random one in the artifact, exit 0)": lambda c: (
        ["export", _hf_weights_without(c, "layer.0.attention.self.query.bias"), "--out", c.tmp / "a"],
        "has no weights for encoder.layer.0.attention.self.query.bias, which its config.json asks for", [c.tmp / "a"]),
    "export: config.json hidden_size 64 over 32-wide weights (said 'look at the above report', with none)": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("hidden_size", 64)), "--out", c.tmp / "a"],
        "the weights hold embeddings.word_embeddings.weight as [", [c.tmp / "a"]),
    "export: num_hidden_layers 200,000 (minutes building layers)": lambda c: (
        ["export", _hf_edited(c, "config.json", _set("num_hidden_layers", 200_000)), "--out", c.tmp / "a"],
        "'num_hidden_layers' is 200,000, more than the 256", [c.tmp / "a"]),
    "export: an empty vocab.txt to build the tokenizer from (a traceback)": lambda c: (
        ["export", _hf_slow_tokenizer(c, {"vocab.txt": ""}), "--out", c.tmp / "a"],
        "vocab.txt (TypeError: sep_token not found in the vocabulary); save the tokenizer again", [c.tmp / "a"]),
    "export: vocab.json and merges.txt without </s> (a traceback)": lambda c: (
        ["export", _hf_slow_tokenizer(c, {"vocab.json": '{"a": 0, "b": 1, "ab": 2}', "merges.txt": "a b\n"}),
         "--out", c.tmp / "a"], "merges.txt (KeyError: '</s>'); save the tokenizer again", [c.tmp / "a"]),
    "export: sentence_bert_config.json not JSON": lambda c: (
        ["export", _hf_edited(c, "sentence_bert_config.json", lambda m: "{bad"), "--out", c.tmp / "a"],
        "cannot read", [c.tmp / "a"]),
    "export: sentence_bert_config.json max_seq_length a string": lambda c: (
        ["export", _hf_edited(c, "sentence_bert_config.json", _set("max_seq_length", "x")), "--out",
         c.tmp / "a"], "'max_seq_length' must be a positive whole number, got 'x'", [c.tmp / "a"]),
    "export: sentence_bert_config.json max_seq_length 1": lambda c: (
        ["export", _hf_edited(c, "sentence_bert_config.json", _set("max_seq_length", 1)), "--out", c.tmp / "a"],
        "a maximum of 1 tokens per text leaves no room for the text", [c.tmp / "a"]),
    "export: modules.json a number": lambda c: (
        ["export", _hf_edited(c, "modules.json", lambda m: 5), "--out", c.tmp / "a"],
        "modules.json holds a JSON int, not a list", [c.tmp / "a"]),
    "export: modules.json of numbers": lambda c: (
        ["export", _hf_edited(c, "modules.json", lambda m: [5]), "--out", c.tmp / "a"],
        "modules.json must list one object per module", [c.tmp / "a"]),
    # below [CLS] + [SEP] + one token the tokenizer truncates nothing: texts ran past the positions (a traceback)
    "export --max-seq-len 2": lambda c: (
        ["export", c.tiny_hf, "--max-seq-len", "2", "--out", c.tmp / "a"],
        "a maximum of 2 tokens per text leaves no room for the text (the tokenizer adds 2 special tokens to each); "
        "use 3 or more", [c.tmp / "a"]),
    "serve --max-seq-len 1": lambda c: (
        ["serve", c.tiny, "--port", "5555", "--port-out", "5556", "--max-seq-len", "1"],
        "a maximum of 1 tokens per text leaves no room", []),
    "bench: a manifest max_seq_len below 1": lambda c: (
        ["bench", c.edited_manifest(_set_in(("model", "max_seq_len"), -5)), "--rounds", "1"],
        "a maximum of -5 tokens per text is no length", []),
    "bench --seq-len past the positions": lambda c: (
        ["bench", c.tiny, "--rounds", "1", "--seq-len", "128"],
        "128 tokens per text exceed the model's 64 positions; use --seq-len and --latency-seq-len", []),
    # a manifest that does not describe its model file: one line when the session opens, not the runtime's error
    "bench: a manifest input of an unknown role": lambda c: (
        ["bench", c.edited_manifest(_set_in(("inputs", 0, "role"), "weird")), "--rounds", "1"],
        "inputs[0] ('input_ids') has role 'weird', which bertopt cannot feed", []),
    "bench: a manifest missing an input": lambda c: (
        ["bench", c.edited_manifest(lambda m: {**m, "inputs": m["inputs"][:1]}), "--rounds", "1"],
        "the model needs input 'attention_mask', which the manifest does not list", []),
    "bench: a manifest output the model has not": lambda c: (
        ["bench", c.edited_manifest(_set_in(("outputs", 0, "name"), "nope")), "--rounds", "1"],  # not the primary
        "the manifest lists output 'nope', which the model has not", []),
    "validate: a lineage source of an unknown kind": lambda c: (
        ["validate", c.edited_manifest(_set_in(("lineage", "source"), {"kind": "bogus"})), "--no-latency",
         "--report-dir", c.tmp / "r"], "the source model recorded in", [c.tmp / "r"]),
    "validate: a lineage source path that is a number": lambda c: (
        ["validate", c.edited_manifest(_set_in(("lineage", "source"), {"kind": "hf", "path": 5})),
         "--no-latency", "--report-dir", c.tmp / "r"],
        "is incomplete (kind 'hf', path 5); name a reference with --reference", [c.tmp / "r"]),
    # an option of another runtime or provider would be recorded in the lineage and do nothing
    "compile --runtime onnxruntime --inference-precision bf16": lambda c: (
        ["compile", c.tiny, "--runtime", "onnxruntime", "--inference-precision", "bf16", "--out", c.tmp / "a"],
        "--inference-precision applies to --runtime openvino only; drop it", [c.tmp / "a"]),
    "compile --runtime onnxruntime --performance-hint THROUGHPUT": lambda c: (
        ["compile", c.tiny, "--runtime", "onnxruntime", "--performance-hint", "THROUGHPUT", "--out", c.tmp / "a"],
        "--performance-hint applies to --runtime openvino only", [c.tmp / "a"]),
    "compile --runtime openvino --trt-fp16": lambda c: (
        ["compile", c.tiny, "--runtime", "openvino", "--trt-fp16", "--out", c.tmp / "a"],
        "--trt-fp16 applies to --provider tensorrt only", [c.tmp / "a"]),
    "export: --tokenizer a folder without one": lambda c: (
        ["export", c.tiny / "model.onnx", "--tokenizer", c.tmp / "nowhere", "--out", c.tmp / "a"],
        f"--tokenizer {c.tmp / 'nowhere'} holds no tokenizer", [c.tmp / "a"]),
    "tune --candidates empty": lambda c: (
        ["tune", c.tiny_hf, "--candidates", ",", "--out", c.tmp / "a"], "'candidates' is empty; name one or more",
        [c.tmp / "a", c.tmp / "a-report"]),
    # an empty path is no path (Path('') is the current folder, which held the input or was taken as it)
    "export with an empty model": lambda c: (["export", "", "--out", c.tmp / "a"], "no model given ('')",
                                             [c.tmp / "a"]),
    "serve --make-curve-keys empty": lambda c: (["serve", "--make-curve-keys", ""],
                                                "serve: 'make_curve_keys' is empty; give a path", []),
    "run a folder as the recipe": lambda c: (["run", c.tmp], f"recipe {c.tmp} is a folder; give the path of a .yaml",
                                             []),
    "prune --out empty": lambda c: (["prune", c.tiny, "--out", ""], "prune: 'out' is empty; give a path", []),
    "tune --out blank": lambda c: (["tune", c.tiny_hf, "--out", " "], "tune: 'out' is empty; give a path", []),
    "tune --targets a speed metric": lambda c: (
        ["tune", c.tiny_hf, "--targets", "cos_min>=0.99,latency_p99_ms@1x16<=100", "--out", c.tmp / "a"],
        "tune: 'targets' names a speed target, 'latency_p99_ms@1x16'; tune's --targets are fidelity thresholds",
        [c.tmp / "a", c.tmp / "a-report"]),
    # the folders made for the output lock go again when the command fails (they were left empty)
    "run: a first stage that cannot take the model": lambda c: (
        ["run", c.recipe(f"name: r\nmodel: {c.tiny_hf}\nstages:\n  - prune: {{}}\n"), "--out",
         c.tmp / "new" / "runs", "--no-compare"], "prune takes a bertopt artifact", [c.tmp / "new"]),
    "run: a tune recipe with a speed target": lambda c: (
        ["run", c.recipe(f"name: r\nmodel: {c.tiny_hf}\ntune: {{targets: 'speedup>=1.2'}}\n"), "--out", c.tmp / "a"],
        "names a speed target, 'speedup'", [c.tmp / "a"]),
    "run: a tune recipe whose data file is missing": lambda c: (
        ["run", c.recipe(f"name: r\nmodel: {c.tiny_hf}\ntune: {{data: 5}}\n"), "--out", c.tmp / "a"],
        "recipe.yaml: tune: 'data' file 5 is not found", [c.tmp / "a"]),
    "quantize --op-types empty": lambda c: (
        ["quantize", c.tiny, "--op-types", "", "--out", c.tmp / "o"], "'op_types' is empty; name operator types",
        [c.tmp / "o"]),
    # said before TensorFlow loads (its start-up lines came before the error line)
    "bench --runtime tensorflow on an ONNX artifact": lambda c: (
        ["bench", c.tiny, "--runtime", "tensorflow"],
        "the TensorFlow runtime runs tf-graphdef and tf-savedmodel artifacts, not onnx", []),
    "run: YAML alias bomb (billion laughs)": lambda c: (
        ["run", c.recipe(_alias_bomb()), "--out", c.tmp / "a"], "the YAML expands to more than", [c.tmp / "a"]),
    "run: YAML nested thousands deep": lambda c: (
        ["run", c.recipe("stages: " + "[" * 5000 + "]" * 5000 + "\n"), "--out", c.tmp / "a"], "nest",
        [c.tmp / "a"]),
    "run: a recipe file of 2 MiB": lambda c: (
        ["run", c.recipe("# padding\n" * 200_000 + "stages: [export]\n"), "--out", c.tmp / "a"],
        "too large for a recipe", [c.tmp / "a"]),

    # hostile ONNX sources, data files and option values (the twenty-first session's hunt): each a traceback, a
    # crash or gigabytes of memory before
    "export: logits declaring a billion labels (a billion-entry label map)": lambda c: (
        ["export", _onnx_source(c, "wide", [("logits", ["batch", 1_000_000_000])], config=True), "--out", c.tmp / "a"],
        "declares its last dimension as 1,000,000,000, not a width from 1 to 1,048,576", [c.tmp / "a"]),
    "export: classifier logits whose width is not fixed, no num_labels in its config": lambda c: (
        ["export", _onnx_source(c, "nodim", [("logits", ["batch", "n"])]), "--out", c.tmp / "a"],
        "the classification output 'logits' does not declare how many labels it has; put num_labels", [c.tmp / "a"]),
    "export: a pooled output of 4 dimensions": lambda c: (
        ["export", _onnx_source(c, "rank4", [("sentence_embedding", ["batch", 2, 2, 8])]), "--out", c.tmp / "a"],
        "ONNX output 'sentence_embedding' has 4 dimensions", [c.tmp / "a"]),
    "export: a graph with no outputs": lambda c: (
        ["export", _onnx_source(c, "none", []), "--out", c.tmp / "a"], "the ONNX graph has no outputs",
        [c.tmp / "a"]),
    "export: a pooled output as wide as the text (stacking its rows was a traceback)":
        lambda c: (["export", _onnx_source(c, "seq-wide", [("sentence_embedding", ["batch", "sequence"])],
                                           computed_as_declared=False), "--out", c.tmp / "a"],
                   "output 'sentence_embedding' came back 1 x 25 for a batch of 1 x 25 tokens, not 1 x 4 as the "
                   "artifact declares (batch x ?)",
                   [c.tmp / "a"]),
    "export: a per-token output that is batch x sequence": lambda c: (
        ["export", _onnx_source(c, "tok-2d", [("last_hidden_state", ["batch", "sequence", 32])],
                                computed_as_declared=False), "--out", c.tmp / "a"],
        "came back 1 x 4 for a batch of 1 x 4 tokens, not 1 x 4 x 32 as the artifact declares", [c.tmp / "a"]),
    "export: a graph that asks 4 TB as it runs (exported, then failed in every command)": lambda c: (
        ["export", _allocation_bomb_source(c), "--out", c.tmp / "a"],
        "failed to run in ONNX Runtime: Failed to allocate memory for requested buffer of size 4000000000000",
        [c.tmp / "a"]),
    "bench an artifact whose graph returns other widths than it declares": lambda c: (
        ["bench", _graph_wider_than_declared(c), "--texts", "8", "--seq-len", "32", "--latency-seq-len", "32"],
        "the graph does not compute what it declares", []),
    "compile a graph wider than declared (the error named a temp folder)": lambda c: (
        ["compile", _graph_wider_than_declared(c), "--runtime", "openvino", "--out", c.tmp / "ov"],
        f"{c.tmp / 'ov'} (being written): the model's output 'sentence_embedding' came back", [c.tmp / "ov"]),
    "export: float input_ids": lambda c: (
        ["export", _onnx_source(c, "floats", input_type=1), "--out", c.tmp / "a"],
        "ONNX input 'input_ids' holds float32, not int64 or int32", [c.tmp / "a"]),
    "export: string input_ids": lambda c: (
        ["export", _onnx_source(c, "strings", input_type=8), "--out", c.tmp / "a"],
        "ONNX input 'input_ids' holds strings, not int64 or int32", [c.tmp / "a"]),
    "export: external data named as the artifact's manifest": lambda c: (
        ["export", _onnx_source(c, "ext-manifest", external="bertopt.json"), "--out", c.tmp / "a"],
        "keeps external data in 'bertopt.json', a name the artifact uses for its own files", [c.tmp / "a"]),
    "export: external data named as the artifact's tokenizer": lambda c: (
        ["export", _onnx_source(c, "ext-tok", external="tokenizer/tokenizer.json"), "--out", c.tmp / "a"],
        "keeps external data in 'tokenizer/tokenizer.json', a name the artifact uses", [c.tmp / "a"]),
    "export: an ONNX file over 2 GiB (refused by its size, not read)": lambda c: (
        ["export", _sparse(c, "huge.onnx", (2 << 30) + 1), "--tokenizer", c.tiny_hf, "--out", c.tmp / "a"],
        "is 2.0 GiB, larger than an ONNX file can be (2 GiB", [c.tmp / "a"]),
    "validate --data a 300 MB text file (not read whole)": lambda c: (
        ["validate", c.tiny, "--data", _sparse(c, "big.txt", 300 << 20), "--no-latency"],
        "big.txt is larger than 256 MiB, too large for a data file; take a sample", []),
    "validate --data a text file of over a million lines": lambda c: (
        ["validate", c.tiny, "--data", c.write("lines.txt", "a\n" * 1_000_001), "--no-latency"],
        "has more than 1,000,000 lines; take a sample", []),
    "quantize --calibration-data a Parquet file of two million rows from a few KB": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-static", "--calibration-data", _parquet_bomb(c), "--out", c.tmp / "q"],
        "holds 2,000,000 rows", [c.tmp / "q"]),
    "validate --data JSONL nested 200,000 deep": lambda c: (
        ["validate", c.tiny, "--data", c.write("deep.jsonl", "[" * 200_000 + "\n"), "--no-latency"],
        "deep.jsonl: line 1 nests lists or objects more than 32 levels deep", []),
    "quantize --exclude-nodes naming no node of the graph (it was ignored)": lambda c: (
        ["quantize", c.tiny, "--mode", "int8-dynamic", "--exclude-nodes", "MatMul_typo", "--out", c.tmp / "q"],
        "--exclude-nodes: no node named 'MatMul_typo' in", [c.tmp / "q"]),
    "export --tokenizer with a Hugging Face folder (it was ignored)": lambda c: (
        ["export", c.tiny_hf, "--tokenizer", c.tiny_hf, "--out", c.tmp / "a"],
        "--tokenizer is for an ONNX file input; a hf model brings its own tokenizer", [c.tmp / "a"]),
    "validate --targets cos_min>=2 (ran the whole gate to fail it)": lambda c: (
        ["validate", c.tiny, "--targets", "cos_min>=2", "--report-dir", c.tmp / "r"],
        "target 'cos_min>=2' can never hold: cos_min is at most 1", [c.tmp / "r"]),
    "validate an artifact whose graph asks 4 TB as it runs": lambda c: (
        ["validate", _allocation_bomb(c), "--no-latency"],
        "failed to run in ONNX Runtime: Failed to allocate memory for requested buffer of size 4000000000000", []),
    "bench --runtime openvino on an artifact whose graph asks 4 TB as it runs": lambda c: (
        ["bench", _allocation_bomb(c), "--runtime", "openvino", "--rounds", "1"], "OpenVINO cannot load", []),
    "validate --threads 100000 (ONNX Runtime crashed making them)": lambda c: (
        ["validate", c.tiny, "--threads", "100000", "--no-latency"], "100000", []),
    "validate --batch-size 10^8 (a batch of that many rows was allocated)": lambda c: (
        ["validate", c.tiny, "--batch-size", "100000000", "--no-latency"], "100000000", []),
    "validate --batch-sizes 999999999": lambda c: (
        ["validate", c.tiny, "--batch-sizes", "999999999", "--seq-lens", "16"], "values must be at most 4,096", []),
    "bench --texts 10^11": lambda c: (["bench", c.tiny, "--texts", "99999999999"], "99999999999", []),
    "serve: a fleet file asking 100000 threads for a model": lambda c: (
        ["serve", "--models", _fleet_file(c, "threads: 100000")], "'threads' must be a whole number from 1 to 1024",
        []),
    "serve: a fleet file asking 100000 workers": lambda c: (
        ["serve", "--models", _fleet_file(c, "workers: 100000")], "'workers' must be a whole number from 1 to 256",
        []),
    # tokenizers (hunt 23): SentencePiece character maps, normalizers, ids past the table, no unknown token
    "export: a charsmap making each letter 10,000 (64 s and 6.7 GB, exit 0)": lambda c: (
        ["export", _xlmr_normalizer(c, {"type": "Precompiled", "precompiled_charsmap": _charsmap(
            {chr(x): "x" * 10_000 for x in range(ord("a"), ord("z") + 1)})}), "--out", c.tmp / "a"],
        "its normalizer can make a text 10,000 times longer", [c.tmp / "a"]),
    "export: a Replace before each of six NFKC steps (measured 1x, 66,000x)": lambda c: (
        ["export", _tokenizer_edit(c, _growing_chain), "--out", c.tmp / "a"],
        "its normalizer can make a text 34,012,224 times longer", [c.tmp / "a"]),
    "export: NFKC then a charsmap of 18 per letter (U+3389 is 'kcal': 72)": lambda c: (
        ["export", _xlmr_normalizer(c, {"type": "Sequence", "normalizers": [{"type": "NFKC"}, {
            "type": "Precompiled", "precompiled_charsmap": _charsmap(
                {chr(x): "x" * 18 for x in range(ord("a"), ord("z") + 1)})}]}), "--out", c.tmp / "a"],
        "its normalizer makes the character U+", [c.tmp / "a"]),
    "export: a charsmap declaring a 4 GB trie (8.6 GB asked, then abort)": lambda c: (
        ["export", _xlmr_normalizer(c, {"type": "Precompiled", "precompiled_charsmap": __import__("base64").b64encode(
            _bad_trie_size(__import__("base64").b64decode(_charsmap({})), 0xFFFFFFF0)).decode()}),
         "--out", c.tmp / "a"],
        "precompiled_charsmap is not a SentencePiece character map (it declares a trie of 4,294,967,280 bytes",
        [c.tmp / "a"]),
    "export: a charsmap cut short (a Rust panic traceback)": lambda c: (
        ["export", _xlmr_normalizer(c, {"type": "Precompiled", "precompiled_charsmap": __import__("base64").b64encode(
            __import__("base64").b64decode(_charsmap({}))[:1000]).decode()}), "--out", c.tmp / "a"],
        "precompiled_charsmap is not a SentencePiece character map", [c.tmp / "a"]),
    "export: an empty sentencepiece.bpe.model (every word <unk>, gate passed)": lambda c: (
        ["export", _xlmr_sentencepiece(c, lambda data: b""), "--out", c.tmp / "a"],
        "sentencepiece.bpe.model holds no pieces, so every word would be an unknown token", [c.tmp / "a"]),
    "export: a sentencepiece.bpe.model cut in half (advice to install tiktoken)": lambda c: (
        ["export", _xlmr_sentencepiece(c, lambda data: data[:len(data) // 2]), "--out", c.tmp / "a"],
        "sentencepiece.bpe.model is not a SentencePiece model (truncated or damaged?)", [c.tmp / "a"]),
    "export: a sentencepiece.bpe.model whose charsmap declares 4 GB (abort)": lambda c: (
        ["export", _xlmr_sentencepiece(c, _with_charsmap_size(0xFFFFFFF0)), "--out", c.tmp / "a"],
        "its normalizer_spec character map is not one (it declares a trie of 4,294,967,280 bytes", [c.tmp / "a"]),
    "export: a token numbered past the embedding table (exported, failed on it)": lambda c: (
        ["export", _tokenizer_edit(c, _sparse_id), "--out", c.tmp / "a"],
        "the id 5000, but the model's embedding table has", [c.tmp / "a"]),
    "export: a post-processor [SEP] numbered past the table": lambda c: (
        ["export", _tokenizer_edit(c, lambda d: d["post_processor"].update(sep=["[SEP]", 99999])),
         "--out", c.tmp / "a"], "gives the post-processor's '[SEP]' the id 99999", [c.tmp / "a"]),
    "export: a post-processor giving a pair's second text a token type past the table (zeros on OpenVINO)":
        lambda c: (["export", _tokenizer_edit(c, pair_type_past_table), "--out", c.tmp / "a"],
                   "gives the second text of a pair the token type 5, but the model's token-type table has 2 rows",
                   [c.tmp / "a"]),
    "export: a WordPiece whose [UNK] is not in its vocabulary (traceback on new words)": lambda c: (
        ["export", _tokenizer_edit(c, lambda d: d["model"].update(unk_token="[NOPE]")), "--out", c.tmp / "a"],
        "cannot encode text outside its vocabulary (WordPiece error: Missing [UNK] token from the vocabulary)",
        [c.tmp / "a"]),
    "export: a Unigram without unk_id (traceback on new words)": lambda c: (
        ["export", _xlmr_unk_free(c), "--out", c.tmp / "a"],
        "cannot encode text outside its vocabulary (Encountered an unknown token but `unk_id` is missing)",
        [c.tmp / "a"]),
}


def run_bertopt(argv, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]),
                                                        os.environ.get("PYTHONPATH", "")]),
           "COLUMNS": "300"}
    return subprocess.run([sys.executable, "-m", "bertopt.cli", *map(str, argv)], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=180)


def test_the_corpus_is_large():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_is_one_line_exit_2_nothing_written(case, tiny_onnx, tiny_hf, tmp_path):
    ctx = Ctx(tmp_path, Path(tiny_onnx.path), Path(tiny_hf))
    argv, expected, must_not_exist = CASES[case](ctx)
    before = sorted(p.name for p in tmp_path.iterdir())
    proc = run_bertopt(argv, tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error:"), lines[0]
    assert expected in lines[0], lines[0]
    for path in must_not_exist:
        assert not Path(path).exists(), f"{path} was left behind"
    # nothing new in the working folder either (no stray temp folders, reports, partial artifacts)
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_spark_predict_on_cuda_without_a_gpu_is_said_before_spark_starts(tiny_onnx, tmp_path):
    from bertopt.spark.placement import visible_gpu_count

    if visible_gpu_count():
        pytest.skip("this machine has a GPU: --provider cuda is valid here")
    (tmp_path / "in.txt").write_text("hello\n")
    proc = run_bertopt(["spark-predict", tiny_onnx.path, "--input", tmp_path / "in.txt", "--output",
                        tmp_path / "o", "--provider", "cuda"], tmp_path)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0] == ("error: provider 'cuda' requested but this machine has no visible GPU; use --provider cpu "
                        "or auto")
    assert not (tmp_path / "o").exists()
