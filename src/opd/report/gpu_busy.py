"""How busy a CUDA device was over a stretch of wall time: the mean of NVML's own utilization samples (each the share
of its sample period, about 1/6 s, in which a kernel ran on the device), read through `pynvml` (nvidia-ml-py, which
CUDA builds of torch install).

Why: a step's phase times say where the wall time went, not whether the GPU was working during it; a trainer bound by
host work (kernel launches, Python between phases, a teacher server's round trips) shows a low fraction. Omitted:
which process ran the kernels (NVML counts the whole device), MIG slices (NVML gives them no utilization samples:
`GpuBusy.open` returns None there, as on CPU or without pynvml).
"""

from __future__ import annotations

import time
from typing import Any

import torch

_GPU_UTILIZATION_SAMPLES = 1  # NVML_GPU_UTILIZATION_SAMPLES


class GpuBusy:
    """Utilization samples of one device since a mark. `open` returns None where NVML cannot give them."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self._nvml, self._handle = nvml, handle
        self._since_us = _now_us()

    @classmethod
    def open(cls, device: torch.device) -> GpuBusy | None:
        """The sampler of `device` (a CUDA device, as torch numbers it under CUDA_VISIBLE_DEVICES), or None: not CUDA,
        no pynvml, a MIG slice, or any NVML error."""
        if device.type != "cuda":
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
            index = device.index if device.index is not None else torch.cuda.current_device()
            uuid = str(torch.cuda.get_device_properties(index).uuid)  # torch prints it without NVML's prefix
            handle = pynvml.nvmlDeviceGetHandleByUUID((uuid if uuid.startswith("GPU-") else f"GPU-{uuid}").encode())
            busy = cls(pynvml, handle)
            busy.fraction()  # fails here, not in the step, where NVML keeps no samples for this device
            return busy
        except Exception:  # noqa: BLE001 - any NVML or import failure means: no samples, no metric
            return None

    def mark(self) -> None:
        """Start a new stretch now."""
        self._since_us = _now_us()

    def fraction(self) -> float | None:
        """Mean utilization (0..1) of the samples taken since the mark (then marks again); None if there were none
        (a stretch shorter than NVML's sample period)."""
        since, self._since_us = self._since_us, _now_us()
        try:
            _, samples = self._nvml.nvmlDeviceGetSamples(self._handle, _GPU_UTILIZATION_SAMPLES, since)
        except self._nvml.NVMLError_NotFound:  # no sample since `since`
            return None
        values = [s.sampleValue.uiVal for s in samples if s.timeStamp > since]
        return sum(values) / len(values) / 100 if values else None


def _now_us() -> int:
    """NVML stamps its samples with the host's wall clock in microseconds."""
    return int(time.time() * 1e6)
