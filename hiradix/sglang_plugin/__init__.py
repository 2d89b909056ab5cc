"""The only package that imports SGLang: plugin entry point, flags, refusals, hooks, the cache seam.

``tests/test_layering.py`` keeps SGLang imports inside this package.
"""
