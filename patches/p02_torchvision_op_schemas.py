"""torchvision: define the nms/qnms operator schemas when its C extension cannot load.

What it changes: `torchvision/extension.py` of the installed torchvision 0.28.0, one
block after the `_load_library("_C")` attempt. When (and only when) the extension did
not load, the block defines the schemas `torchvision::nms` and `torchvision::qnms`
in a `torch.library` fragment; no kernels are registered.

Why: the torchvision 0.28.0 wheel on PyPI is linked against CUDA, so next to the CPU
build of torch its `_C.so` fails to load. torchvision copes with that everywhere
except `_meta_registrations.py`, which registers fake kernels for nms/qnms without
checking, so `import torchvision` dies with "operator torchvision::nms does not
exist". transformers imports torchvision (image utils), and SGLang imports
transformers, so nothing starts. With the schemas defined the import works and the
ops stay unusable (torchvision's own `_assert_has_ops` still reports them missing);
SGLang's text-model path never calls them.

Skipped when `import torchvision` already works (a wheel whose C extension loads).
"""

from __future__ import annotations

from _patchlib import (
    ALREADY,
    SKIPPED,
    Edit,
    PatchError,
    edit_file,
    installed_file,
    installed_version,
    python_ok,
    require_sglang_version,
)

NAME = "torchvision-op-schemas"
MARKER = "hiradix-patch: torchvision-op-schemas"
TORCHVISION_VERSION = "0.28.0"

ANCHOR = '''if _load_library("_C"):

    def _has_ops():  # noqa: F811
        return True
'''

BLOCK = f'''

# {MARKER} (hiradix patches/p02_torchvision_op_schemas.py)
# The C extension did not load (e.g. a CUDA-linked wheel next to a CPU torch), but
# _meta_registrations registers fake kernels for nms/qnms unconditionally; define
# their schemas (no kernels) so that `import torchvision` works.
if not _has_ops():
    _hiradix_schema_lib = torch.library.Library("torchvision", "FRAGMENT")
    for _hiradix_schema in (
        "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
        "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    ):
        if not hasattr(torch.ops.torchvision, _hiradix_schema.split("(")[0]):
            _hiradix_schema_lib.define(_hiradix_schema)
'''


def apply() -> tuple[str, str]:
    require_sglang_version()
    if installed_version("torchvision") is None:
        return SKIPPED, "torchvision is not installed"
    path = installed_file("torchvision", "torchvision/extension.py")
    if MARKER in path.read_text(encoding="utf-8"):
        return ALREADY, str(path)
    ok, last = python_ok("import torchvision")
    if ok:
        return SKIPPED, "not needed: import torchvision works"
    if "torchvision::nms does not exist" not in last:
        raise PatchError(f"{path}: import torchvision fails for another reason: {last}")
    found = installed_version("torchvision")
    if found != TORCHVISION_VERSION:
        raise PatchError(f"{path}: written for torchvision=={TORCHVISION_VERSION}; installed: {found}")
    status = edit_file(path, MARKER, [Edit(ANCHOR, ANCHOR + BLOCK)])
    ok, last = python_ok("import torchvision")
    if not ok:
        raise PatchError(f"{path}: patched, but import torchvision still fails: {last}")
    return status, str(path)
