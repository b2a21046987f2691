"""Triton kernels, one file per family: `_kernel` functions and a thin launcher on validated inputs.

The public, validated entry points are in `pqattn.ops`; each kernel's fuzz check is in
`pqattn.lab.kernel_checks`.
"""
