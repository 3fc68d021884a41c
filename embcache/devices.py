"""Devices as embcache keeps them: a CUDA device always carries its index.

torch accepts ``torch.device("cuda")`` almost everywhere, meaning "the current device", but
some calls refuse it (``torch.cuda.set_device`` raises ``ValueError: Expected a torch.device
with a specified index``), and "current" is per thread: a worker thread's current device is
device 0 whatever the training thread chose. So wherever a device is accepted (a collection,
a cache, a worker), `resolve_device` fixes the index once, on the thread that gave it.
"""

from __future__ import annotations

import torch


def resolve_device(device: torch.device | str | int) -> torch.device:
    """``device`` as a `torch.device`, a CUDA device without an index given the calling
    thread's current one (``cuda`` -> ``cuda:<torch.cuda.current_device()>``).

    Args:
        device: a `torch.device`, a device string (``"cpu"``, ``"cuda"``, ``"cuda:1"``,
            ``"meta"``) or a CUDA device index.

    Returns:
        The device; every other device (CPU, meta, an indexed CUDA device) unchanged.

    Raises:
        TypeError: ``device`` is none of these types (a bool included).
        ValueError: a string or index torch does not take as a device.
    """
    if isinstance(device, bool) or not isinstance(device, (torch.device, str, int)):
        raise TypeError(
            f"device must be a torch.device, a device string or a CUDA index, "
            f"got {type(device).__name__}"
        )
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"not a device: {device!r} (a CUDA index is >= 0)")
        return torch.device("cuda", device)  # torch would ask for the machine's accelerator
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except (RuntimeError, ValueError) as err:  # torch says RuntimeError for a bad string
            raise ValueError(f"not a device: {device!r} ({err})") from None
    if device.type == "cuda" and device.index is None:
        # Asked once, here: the caller's thread is the one whose current device was meant.
        return torch.device("cuda", torch.cuda.current_device())
    return device
