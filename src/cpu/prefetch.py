"""A software prefetch for Numba kernels: ``llvm.prefetch`` as a Numba intrinsic.

The paged KV cache's blocks lie where the block manager put them, so a
sequence's next block is a jump the hardware prefetchers cannot guess: each
block began with cache misses. :func:`prefetch_line` asks for a line ahead
of its use; it has no effect on any value (a prefetch never faults, even on
an address that is not mapped), which is why no test can see it and only
``tools/bench_kernels.py`` (a working set beyond the last-level cache) can.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic

#: Bytes per cache line on x86-64 and on the ARM cores kvserve runs on.
CACHE_LINE = 64


@intrinsic
def prefetch_line(typingctx, address):
    """Prefetch the cache line holding byte ``address`` (an integer, e.g.
    ``array.ctypes.data + offset``) for reading, into all cache levels
    (LLVM's ``llvm.prefetch(ptr, rw=0, locality=3, data=1)``)."""
    if not isinstance(address, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        module = builder.module
        name = "llvm.prefetch.p0"
        fn = module.globals.get(name) or ir.Function(module, fnty, name=name)
        pointer = builder.inttoptr(builder.zext(args[0], ir.IntType(64))
                                   if args[0].type.width < 64 else args[0], i8p)
        builder.call(fn, [pointer, i32(0), i32(3), i32(1)])
        return context.get_dummy_value()

    return types.void(address), codegen
