"""The checks behind ``scripts/gpu_check`` (a directory of modules the script puts on ``sys.path``).

They live under ``scripts/`` and not ``bench/``: the layer-wise check needs SGLang's
``LayerDoneCounter`` itself, and only ``hiradix.sglang_plugin`` may import SGLang in the package
and in ``bench/`` (``tests/test_layering.py``).
"""
