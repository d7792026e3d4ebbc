"""The ``pytorch`` runtime backend: a torch module (a Hugging Face model with its pooling, the reference a source
model is compared with) run as a session. The model handle (format ``pytorch``) carries the module
(``model.module``) and may ask for bf16 autocast in ``runtime_options`` (``{"bf16": true}``). PyTorch is imported
on first use."""

from __future__ import annotations

import numpy as np

from bertopt.errors import UserError
from bertopt.model_handle import ModelHandle
from bertopt.runtime.backends import default_threads, register_backend


class TorchSession:
    """PyTorch as a runtime session (``run(output_names, feeds)``), so the reference model runs through
    the same tokenisation, batching and comparison code as artifacts. ``bf16`` uses CPU autocast (AMX)."""

    backend = "pytorch"
    concurrent_runs = True
    parallel_runs = 1

    def __init__(self, module, input_names: list[str], output_names: list[str], threads: int | None = None,
                 bf16: bool = False):
        import torch

        self.torch = torch
        self.module = module
        self.output_names = output_names
        self.input_names = list(input_names)
        self.bf16 = bf16
        self.provider = "cpu-bf16-autocast" if bf16 else "cpu"
        self.threads = threads or default_threads()
        torch.set_num_threads(self.threads)

    def run(self, output_names, feeds):
        torch = self.torch
        args = [torch.from_numpy(np.ascontiguousarray(feeds[n])) for n in self.input_names]
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.bf16):
            outs = self.module(*args)
        by_name = dict(zip(self.output_names, outs))
        return [by_name[n].float().numpy() for n in output_names]


@register_backend("pytorch")
def open_torch_session(model: ModelHandle, provider: str = "auto", threads: int | None = None) -> TorchSession:
    if provider not in ("auto", "cpu"):
        raise UserError(f"the PyTorch reference runs on CPU in bertopt; provider '{provider}' is not available "
                        "(use --provider cpu)")
    if model.model_format != "pytorch":
        raise UserError(f"{model.path} holds no PyTorch module to run; the pytorch runtime runs reference models "
                        "built from Hugging Face folders")
    return TorchSession(model.module, [i["name"] for i in model.inputs], [o["name"] for o in model.outputs],
                        threads=threads, bf16=bool(model.runtime_options.get("bf16")))
