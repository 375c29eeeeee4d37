"""PLACEHOLDER: the Triton layer_norm kernels land with their issue."""


def compile_cases():
    return []
