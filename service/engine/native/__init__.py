"""This project's own ONNX Runtime kernels, compiled when the package is installed (pyproject.toml's
ext-modules; optional: an install without a C++ compiler goes on without them).

ops.cc: `ElmoCellStep`, one step of the projected LSTM cell between its products (the Loop graphs'
`model_export.onnx_graph.CELL_OP`; int8's `ElmoScaledCellStep`, `SCALED_CELL_OP`, applies its products' rows'
scales too), and `ElmoQuantizeRows`, int8's quantization of each row of a product's input
with a scale of its own (`QUANTIZE_OP`). The graphs carry each op's definition in standard ONNX ops as well (an
ONNX function), which ONNX Runtime inlines wherever no kernel of that name is registered: without the library an
engine computes the same numbers, only slower (docs/performance.md, "The time around the products")."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path

LIBRARY = f"{__name__}._ops"  # a shared library built as an extension module, never imported


def library() -> Path | None:
    """The compiled kernels' library file, or None where the install built none."""
    spec = find_spec(LIBRARY)
    return Path(spec.origin) if spec is not None and spec.origin else None
