"""Triton interpreter fixes the suite needs on older Tritons (the device's 3.6).

Triton 3.6's interpreter turns a scalar tensor into a Python int (a `range` bound in a
kernel: `for kv_tile in range(tile_lo, tile_hi)`) with `int()` of its one-element array;
NumPy 2.4 refuses `int()` of an array with a dimension. Triton 3.7 squeezes the array
first. The kernels are the same on a GPU, where nothing is interpreted: only the CPU
suite's interpreter children need this, and they call it before running a kernel.
"""

from __future__ import annotations


def fix_interpreter_scalar_index() -> None:
    """Make the interpreter's `tensor.__index__` take a one-element array (as 3.7's
    does). Harmless where it already does: a 0-d array squeezes to itself."""
    from triton.runtime import interpreter

    patch = getattr(interpreter, "_patch_lang_tensor", None)
    if patch is None or getattr(patch, "scalar_index_fixed", False):
        return

    def patch_lang_tensor(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patch_lang_tensor.scalar_index_fixed = True
    interpreter._patch_lang_tensor = patch_lang_tensor


# The lines a `python -c` interpreter child runs first.
CHILD_PRELUDE = ("from tests.helpers.triton_compat import fix_interpreter_scalar_index\n"
                 "fix_interpreter_scalar_index()\n")
