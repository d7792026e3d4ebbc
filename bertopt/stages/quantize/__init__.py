"""The quantize stage and its methods: ``stage.py`` (the stage: shared options, method choice), ``methods.py`` (how
method groups compose), one module per method family (``onnxruntime_int8.py``, ``openvino_int8.py``, ``fp16.py``)
and the libraries they share (``calibration.py``, ``smoothing.py``, ``gptq.py``, ``accuracy_aware.py``)."""
