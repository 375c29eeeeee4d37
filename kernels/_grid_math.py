"""The integer arithmetic launchers size grids and blocks with: ceil division, powers of 2 and a
GPU's SM count, each cheaper than Triton's or torch's own per call."""
import torch

_SM_COUNTS = {}


def sm_count(device):
    """The number of SMs (streaming multiprocessors) of the CUDA `device`, read once per device
    (torch.cuda.get_device_properties costs microseconds a call, and launchers ask on every call)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    count = _SM_COUNTS.get(index)
    if count is None:
        count = _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return count


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv's constexpr wrapper costs ~5 us a call, as below)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (1 for n <= 1). Plain Python: triton.next_power_of_2 goes
    through a constexpr wrapper that costs ~5 us a call, and launchers make several per call."""
    return 1 << (max(int(n), 1) - 1).bit_length()
