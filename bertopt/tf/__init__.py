"""The TensorFlow path: bertopt's own Keras BERT (Hugging Face weights or a Google checkpoint), freeze,
prune, fp16 and tf2onnx export of TensorFlow graphs, and TensorFlow sessions for the runtime.

Every module here imports TensorFlow at the top, so import them only inside functions, after
``bertopt.errors.require("tensorflow", "tf")``; ``bertopt --help`` never loads TensorFlow.
"""
