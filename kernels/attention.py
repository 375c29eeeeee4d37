"""PLACEHOLDER: the Triton attention kernels land with their issue."""


def compile_cases():
    return []
