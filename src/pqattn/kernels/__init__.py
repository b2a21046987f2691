"""Triton kernels by family (a file, or a folder where a family has several: `select/`), each
with its `_kernel` functions, a thin launcher on validated inputs and its autotune space; device
helpers shared across families are in `codes`, launching and plans in `launch`, PDL in `pdl`.

The public, validated entry points are in `pqattn.ops` and `PQIndex`, which reach the kernels
only through `pqattn.dispatch`; each kernel's fuzz check is in `pqattn.lab.kernel_checks`.
"""

import functools


def autotuners() -> dict:
    """The autotuned launchers by kernel name (their `best_config` is the config of the last call)."""
    from pqattn.kernels import attention, decode
    from pqattn.kernels.select import tree

    return {
        "flash_forward": attention.flash_forward_autotuned,
        "pq_select": tree.pq_select_autotuned,
        "sparse_decode": decode.sparse_decode_autotuned,
    }


@functools.cache
def kernel_names() -> frozenset[str]:
    """The names of every Triton kernel the package launches (as profilers list them)."""
    import importlib
    import pkgutil

    from triton.runtime.jit import KernelInterface

    import pqattn.kernels as package

    names = set()
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        module = importlib.import_module(info.name)
        for obj in vars(module).values():
            # a @triton.jit function (JITFunction, or InterpretedFunction under TRITON_INTERPRET)
            name = getattr(obj, "__name__", "")
            if isinstance(obj, KernelInterface) and name.endswith("_kernel"):
                names.add(name)
    return frozenset(names)
