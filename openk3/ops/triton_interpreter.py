"""Run fla's Triton kernels on the CPU through Triton's interpreter (`TRITON_INTERPRET=1`), for tests.

The interpreter executes `@triton.jit` kernels with numpy, one program of the grid after another, so the CUDA
path of openk3 (fla's `chunk_kda`, its causal conv and gated norm) can be checked against the CPU twins on a
machine without a GPU. It is a checking tool (1-20 s per kernel call at T = 64, H = 2), float32 only: under the
interpreter `tl.dot` on bfloat16 multiplies the raw 16-bit patterns (triton#11584), so bf16 kernels can only be
checked on a GPU (scripts/gpu_check.sh).

Four gaps of the interpreter stop fla's kernels (triton 3.7.1; machine-facts §9); `patch()` closes them, once,
before fla is imported:

1. autotuned kernels benchmark their configs through the GPU driver ("0 active drivers"): instead each config is
   timed by how many programs it launches, the inverse of the product of its block sizes, so the largest blocks
   run (the interpreter runs programs one after another and vectorises within one: fla's short convolution
   took 8x longer with its first config, 16-channel blocks, than with 128). Every config is a valid
   alternative of the same kernel; the GPU's autotuner may pick any of them;
2. `for` loop variables stay Python ints, so fla's `i_t.to(tl.int64)` fails: the interpreter already rewrites
   every kernel's assignments to make interpreter tensors; the loop variable gets the same treatment at the top
   of each loop body;
3. builtins bound to a module-level name (`gather = tl.gather` in `fla/ops/utils/op.py`, imported by kernels as
   `gather`) are not swapped for their interpreted versions, which the interpreter does only for attributes of
   `triton.language`: the kernel's globals are patched too, and restored with the rest after the launch;
4. fla's safe-gate kernels ask `tl.dot` for `input_precision="bf16x3"` (three bf16 terms per float32 operand,
   ~float32 accuracy on tensor cores), which the interpreter refuses although its `tl.dot` ignores the precision
   and always multiplies in float32: it is accepted (and computed as float32, as every other precision is).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import os

#: Triton versions whose interpreter these patches were written against and tested with (`.ci/run` installs it).
TESTED_TRITON = ("3.7.1",)


def interpreting() -> bool:
    """True when `TRITON_INTERPRET` asks for the interpreter (read as triton reads it: 1 / true / on / yes)."""
    return os.environ.get("TRITON_INTERPRET", "").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def patch() -> None:
    """Apply the four interpreter patches (idempotent). ValueError when triton is missing or untested."""
    if not interpreting():
        raise ValueError("openk3.ops.triton_interpreter.patch: TRITON_INTERPRET=1 must be set (before fla or "
                         "triton's kernels are imported) to run Triton kernels on the CPU")
    try:
        import triton
    except ImportError as e:
        raise ValueError(f"backend='fla' on the CPU needs triton's interpreter: pip install "
                         f"triton=={TESTED_TRITON[-1]} fla-core==0.6.0 (not importable: {e})") from None
    if triton.__version__ not in TESTED_TRITON:
        raise ValueError(f"backend='fla' on the CPU: openk3 patches Triton's interpreter as tested with triton "
                         f"{' / '.join(TESTED_TRITON)}; this is triton {triton.__version__} "
                         f"(pip install triton=={TESTED_TRITON[-1]})")
    import triton.language as tl
    from triton.runtime import autotuner, interpreter

    # 1. The autotuner: fewest programs first (ties keep the earlier config: `min` returns the first minimum).
    def programs(self, *args, config, **meta):
        blocks = math.prod(v for v in config.kwargs.values() if isinstance(v, int) and not isinstance(v, bool))
        return [1.0 / max(blocks, 1)] * 3

    autotuner.Autotuner._bench = programs

    # 2. Loop variables as interpreter tensors.
    class LoopVariables(interpreter.ASTTransformer):
        def visit_For(self, node: ast.For) -> ast.For:
            self.generic_visit(node)
            if isinstance(node.target, ast.Name):
                name = node.target.id
                convert = ast.Assign(targets=[ast.Name(id=name, ctx=ast.Store())],
                                     value=ast.Name(id=name, ctx=ast.Load()))
                node.body.insert(0, self.visit_Assign(convert))  # the interpreter's own x = to_tensor(x)
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVariables()

    # 3. Module-level aliases of builtins in the kernel's globals.
    patch_lang = interpreter._patch_lang

    def interpreted(member):
        def call(*args, **kwargs):
            kwargs = {k: v for k, v in kwargs.items() if k != "_semantic"}
            return member(*args, **kwargs, _semantic=interpreter.interpreter_semantic)
        return call

    class Scope:
        def __init__(self, inner, globals_: dict, saved: list) -> None:
            self.inner, self.globals, self.saved = inner, globals_, saved

        def restore(self) -> None:
            for name, value in self.saved:
                self.globals[name] = value
            self.inner.restore()

    def patch_lang_and_aliases(fn):
        scope = patch_lang(fn)
        globals_ = fn.__globals__
        saved = [(name, value) for name, value in list(globals_.items())
                 if not isinstance(value, type) and callable(value) and tl.core.is_builtin(value)]
        for name, value in saved:
            globals_[name] = interpreted(value)
        return Scope(scope, globals_, saved)

    interpreter._patch_lang = patch_lang_and_aliases

    # 4. bf16x3 / bf16x6 dot precisions (float32 matmuls under the interpreter).
    options = interpreter.interpreter_builder.options
    extra = tuple(p for p in ("bf16x3", "bf16x6") if p not in options.allowed_dot_input_precisions)
    interpreter.interpreter_builder.options = dataclasses.replace(
        options, allowed_dot_input_precisions=options.allowed_dot_input_precisions + extra)
