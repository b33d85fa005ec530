"""Copy checkpoint tensors (host memory, typically mmap'd safetensors) into device tensors.

Direct mode (the CPU engine): ``dst.copy_(src)``, one copy that converts dtype on the way.

Staged mode (CUDA): a reader thread copies the next tensor, converted to the target dtype, into
one of two pinned host buffers while the main thread's asynchronous host-to-device copy of the
previous buffer runs on a side stream; a buffer is refilled only after the event recorded behind
its last copy has completed. Tensors larger than a buffer go in chunks. Reading the page cache
and the PCIe transfer overlap, and pageable memory never reaches the copy engine (which would
stage it through the driver's own small buffers, one tensor at a time).

    with StagedCopier(device, dtype) as c:
        for dst, load in pairs:
            c.copy(dst, load)      # load() -> the host tensor; called on the reader thread
    # all copies are complete here
"""
from __future__ import annotations

import queue
import threading
from typing import Callable

import torch

BUFFER_BYTES = 128 << 20  # per staging buffer; two of them


class StagedCopier:
    def __init__(self, device: torch.device, dtype: torch.dtype, staged: bool | None = None,
                 buffer_bytes: int = BUFFER_BYTES):
        self.device, self.dtype = torch.device(device), dtype
        self.staged = self.device.type == "cuda" if staged is None else staged
        self.buffer_bytes = buffer_bytes
        self.items: list[tuple[torch.Tensor, Callable[[], torch.Tensor]]] = []

    def copy(self, dst: torch.Tensor, load: Callable[[], torch.Tensor]) -> None:
        if not self.staged:
            src = load()
            _check_shape(dst, src)
            dst.copy_(src)
        else:
            self.items.append((dst, load))  # run at __exit__, in order

    def __enter__(self) -> "StagedCopier":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None and self.items:
            self._run_staged()
        self.items = []

    # ---- staged ----------------------------------------------------------------------------
    def _run_staged(self) -> None:
        cuda = self.device.type == "cuda"
        bufs = [torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=cuda) for _ in range(2)]
        stream = torch.cuda.Stream(self.device) if cuda else None
        free: queue.Queue = queue.Queue()
        for k in range(len(bufs)):
            free.put((k, None))
        filled: queue.Queue = queue.Queue()  # bounded by the two buffers, plus the end marker
        stop = threading.Event()

        def reader() -> None:
            try:
                for dst, load in self.items:
                    src = load()
                    _check_shape(dst, src)
                    if not dst.is_contiguous():
                        raise ValueError("staged copies need contiguous destinations")
                    src, out = src.reshape(-1), dst.view(-1)
                    per = max(1, self.buffer_bytes // dst.element_size())
                    for i in range(0, src.numel(), per):
                        k, event = free.get()
                        if stop.is_set():
                            return
                        if event is not None:
                            event.synchronize()  # its last host-to-device copy is done
                        n = min(per, src.numel() - i)
                        view = bufs[k][:n * dst.element_size()].view(dst.dtype)
                        view.copy_(src[i:i + n])  # page cache -> pinned, dtype converted
                        filled.put((k, out[i:i + n], view))
                filled.put(None)
            except BaseException as e:  # handed to the main thread, which re-raises it
                filled.put(e)

        thread = threading.Thread(target=reader, name="batchrun-weight-reader", daemon=True)
        thread.start()
        try:
            while True:
                item = filled.get()
                if item is None:
                    break
                if isinstance(item, BaseException):
                    raise item
                k, out, view = item
                if cuda:
                    with torch.cuda.stream(stream):
                        out.copy_(view, non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
                else:
                    out.copy_(view)
                    event = None
                free.put((k, event))
            if cuda:
                stream.synchronize()
        finally:
            stop.set()
            free.put((0, None))  # wakes a reader still waiting for a buffer
            thread.join()


def _check_shape(dst: torch.Tensor, src: torch.Tensor) -> None:
    # inspect_model has checked every shape against config.json; this guards the copy itself
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"checkpoint tensor of shape {list(src.shape)} for a parameter of shape {list(dst.shape)}")
