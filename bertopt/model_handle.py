"""The model handle: what a runtime opens, as one type.

An artifact (``Artifact.model_handle()``, the staged view a stage self-checks included), a source model (the
Hugging Face reference, ``sources.hf.hf_model_handle``; a TensorFlow source; an ONNX file) and a bare model file
(``runtime.backends.open_model``) all produce a ``ModelHandle``; ``runtime.open_session``, ``Predictor`` and every
backend take one. It says what the model is made of (a verified file or folder, serialised bytes, or an in-memory
framework object), which format that is, which runtime opens it and with which options, its inputs and outputs,
where its tokenizer is, and what the model is (family, task, pooling, labels, position limit: ``model_info``).

Like Olive's model handlers and Polygraphy's loaders, the handle is a description and opens nothing itself. It is
frozen: a variant (other runtime options, another runtime) is ``dataclasses.replace(handle, ...)``, never an
attribute set on a shared object.

A handle built from an artifact carries only paths of files its manifest lists: ``Artifact.load`` checked that each
stays inside the folder and is a regular file and verified its sha256 (serve workers load, and so verify, on every
start and restart); a handle is made after that and holds no file open. ``model_files`` names every file the
runtime reads for the model (the model file first, then an ONNX model's external data or an OpenVINO IR's
``model.bin``), so a format of more than one file is carried whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# model format -> the runtime that opens it when the caller names none
DEFAULT_RUNTIMES = {
    "onnx": "onnxruntime",
    "openvino-ir": "openvino",  # model.xml + model.bin
    "tf-savedmodel": "tensorflow",
    "tf-graphdef": "tensorflow",
    "tensorflow": "tensorflow",  # an in-memory TensorFlow callable (a TF source model: SavedModel, .keras, checkpoint)
    "pytorch": "pytorch",  # an in-memory torch module (a Hugging Face source model with its head and pooling)
}
# formats the handle holds as an in-memory object (``module``) rather than a file
IN_MEMORY_FORMATS = ("tensorflow", "pytorch")
# an OpenVINO static int8 artifact may run its short texts on a float copy of its model (``runtime_options``
# ``float_short_texts``: texts of at most that many tokens): that copy's IR, beside model.xml, hashed like it
FLOAT_SHORT_TEXTS = "float_short_texts"
FLOAT_MODEL_FILE = "float.xml"


def primary_output(model: Any) -> str | None:
    """The output ``encode`` returns: the model info's ``primary_output``, else the last output (``model`` is an
    Artifact or a ModelHandle)."""
    return model.model_info.get("primary_output") or (model.outputs[-1]["name"] if model.outputs else None)


def primary_output_problem(primary: str | None, outputs: Any) -> str | None:
    """Why ``primary`` cannot be a model's primary output (None: it can, or none is named): it must be one of
    ``outputs``. Checked when a manifest is loaded and by validate, in these words."""
    names = [o["name"] for o in outputs]
    if primary is None or primary in names:
        return None
    return f"primary output {primary!r:.80} is not among the outputs ({', '.join(names)})"


def reads_token_types(inputs: Any) -> bool:
    """Whether a model with these input specs reads token type ids (an input whose role is token_type_ids; a spec
    without a role is named for it): the one test of whether a tokenizer's token types must fit its table."""
    return any(spec.get("role", spec["name"]) == "token_type_ids" for spec in inputs)


def attention_mask_input(inputs: Any) -> str | None:
    """The name of the input that carries the attention mask (role attention_mask; a spec without a role is named
    for it, a Google checkpoint's input_mask too), or None: what a text's token count is read from."""
    return next((spec["name"] for spec in inputs
                 if spec.get("role", spec["name"]) in ("attention_mask", "input_mask")), None)


def output_kinds(outputs: Any) -> dict[str, str]:
    """Output name -> kind (embedding, token, logits, ...); an output that records none is an embedding."""
    return {o["name"]: o.get("kind", "embedding") for o in outputs}


@dataclass(frozen=True, eq=False)
class ModelHandle:
    """One model as a runtime opens it. ``path`` and ``digest`` name it in messages and reports (an artifact's
    folder and digest; a source model's path and a label such as ``pytorch:PATH``)."""

    model_format: str
    inputs: tuple[dict[str, Any], ...]
    outputs: tuple[dict[str, Any], ...]
    tokenizer_path: Path | None
    model_info: dict[str, Any]
    path: Path | None
    digest: str
    model_path: Path | None = None  # the model file (or SavedModel folder); for an IR, model.xml
    model_bytes: bytes | None = None  # the serialised model, when it is not (only) a file
    model_files: tuple[Path, ...] = ()  # every file the runtime reads for the model, model_path first
    module: Any = None  # in-memory formats: the torch module, or the TF signature-style callable
    keep_alive: Any = None  # what ``module`` needs alive (the SavedModel / Keras object owning its variables)
    runtime: str = ""  # the backend that opens it; "" = the format's default (DEFAULT_RUNTIMES)
    runtime_options: dict[str, Any] = field(default_factory=dict)
    signature: str | None = None  # tf-savedmodel: the serving signature to run
    precision: str = "fp32"

    def __post_init__(self) -> None:
        if self.model_format not in DEFAULT_RUNTIMES:
            raise ValueError(f"unknown model format {self.model_format!r}; one of {', '.join(DEFAULT_RUNTIMES)}")
        if self.model_format in IN_MEMORY_FORMATS:
            if self.module is None:
                raise ValueError(f"a {self.model_format} handle carries its model in memory (module=...)")
        elif self.model_path is None and self.model_bytes is None:
            raise ValueError(f"a {self.model_format} handle needs model_path or model_bytes")
        # frozen: normalised through object.__setattr__ once, here
        object.__setattr__(self, "inputs", tuple(self.inputs))
        object.__setattr__(self, "outputs", tuple(self.outputs))
        object.__setattr__(self, "runtime_options", dict(self.runtime_options or {}))
        if not self.runtime:
            object.__setattr__(self, "runtime", DEFAULT_RUNTIMES[self.model_format])
        if self.model_path is not None and not self.model_files:
            object.__setattr__(self, "model_files", (self.model_path,))

    @property
    def primary_output(self) -> str | None:
        return primary_output(self)

    @property
    def output_kinds(self) -> dict[str, str]:
        return output_kinds(self.outputs)

    def check_graph_io(self, inputs, outputs) -> None:
        """The inputs and outputs the manifest lists against the ones the opened graph has: a manifest that does not
        describe its model file is one line when the session opens, not an error inside the runtime on the first
        request. ``inputs``: each graph input's name, or the set of names it answers to (OpenVINO ports have
        several); ``outputs``: every name an output answers to."""
        from bertopt.errors import ArtifactError

        if not self.inputs and not self.outputs:  # a bare model file (``open_model``): nothing listed to hold to
            return
        ports = [{names} if isinstance(names, str) else set(names) for names in inputs]
        listed = [i["name"] for i in self.inputs]
        known = set().union(*ports)
        problems = [f"the model needs input '{min(names)}', which the manifest does not list" for names in ports
                    if not names & set(listed)]
        problems += [f"the manifest lists input '{n}', which the model has not" for n in listed if n not in known]
        problems += [f"the manifest lists output '{o['name']}', which the model has not" for o in self.outputs
                     if o["name"] not in outputs]
        if problems:
            raise ArtifactError(f"{self.shown_as}: {problems[0]}; re-create the artifact")

    @property
    def shown_as(self) -> str:
        """The model's name in an error line: its file, else the folder or source it came from."""
        return str(self.model_path or self.path or self.digest)
