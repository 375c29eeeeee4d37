"""The launch machinery's checks without a GPU: a recording Triton driver and CUDA library, and the
checks that tests/test_direct_launch.py runs in processes of their own (see each module)."""
