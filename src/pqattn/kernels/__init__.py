"""Triton kernels, one file per family: `_kernel` functions and a thin launcher on validated inputs.

The public, validated entry points are in `pqattn.ops`; each kernel's fuzz check is in
`pqattn.lab.kernel_checks`.
"""


def autotuners() -> dict:
    """The autotuned launchers by kernel name (their `best_config` is the config of the last call)."""
    from pqattn.kernels import attention, decode, select

    return {
        "flash_forward": attention._flash_forward_autotuned,
        "pq_select": select._pq_select_autotuned,
        "sparse_decode": decode._sparse_decode_autotuned,
    }
