"""Chapter 19 — sleep mode: a worker hands its model's memory back while the server idles (vLLM's sleep / wake_up).

    level 1   every byte of the weights (float32, int8 or Q4_1 blocks, large-step copies, LoRA slots: as they are in
              memory) goes to a temporary file, and the memory is freed. Wake: one read of the file back, no
              parsing, no dequantizing, no repacking.
    level 2   the weights are dropped. Wake: the model is built again from its GGUF (the `loader` the engine was
              given), the whole load, and its tensors are taken over.

vLLM's level 1 offloads the weights from GPU memory to CPU memory; a CPU server has no host memory below its own,
so the tier below the process is a file: written once, it sits in the OS page cache (which the kernel may write
back and drop under pressure) and counts in no process' resident set. The file is unlinked from the start
(tempfile.TemporaryFile): nothing is left on disk, even by a crash.

A tensor *object* survives sleep; only its storage goes (Tensor.set_ to an empty one: shape (0,) while asleep) and
comes back behind the same object. The modules, a tied LM head, the LoRA layers wrapping a projection and the
draft proposer that shares the target's blocks all hold the same objects before and after, and tensors that shared
one storage (a tied embedding and LM head) share it again after wake:

    SleepingWeights(model, level=1)      model.lm_head.weight.shape == (0,), RSS down by `.nbytes`
    .wake()                              model.lm_head.weight.shape == (49152, 576) again, the same bytes
"""

import tempfile
from dataclasses import dataclass, field

import numpy as np
import torch

SLEEP_LEVELS = (1, 2)


def model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor the model holds, each under the first name it is found at: parameters, buffers and plain tensor
    attributes (a quantized layer's large-step copy, chapter 10). The same structure gives the same names, which is how
    level 2 finds each tensor in the rebuilt model."""
    found, seen = {}, set()
    for prefix, module in model.named_modules(remove_duplicate=False):
        attrs = [*module.named_parameters(recurse=False, remove_duplicate=False),
                 *module.named_buffers(recurse=False, remove_duplicate=False), *vars(module).items()]
        for name, t in attrs:
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                found[f"{prefix}.{name}" if prefix else name] = t
    return found


@dataclass
class _Storage:
    """One storage and every tensor viewing it: (name, tensor, offset, size, stride) each, to put them back."""

    nbytes: int
    views: list[tuple[str, torch.Tensor, int, tuple, tuple]] = field(default_factory=list)


def _storages(tensors: dict[str, torch.Tensor]) -> list[_Storage]:
    by_ptr: dict[int, _Storage] = {}
    for name, t in tensors.items():
        storage = t.untyped_storage()
        if storage.nbytes() == 0:
            continue
        s = by_ptr.setdefault(storage.data_ptr(), _Storage(storage.nbytes()))
        s.views.append((name, t, t.storage_offset(), tuple(t.shape), t.stride()))
    return list(by_ptr.values())


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A (nbytes,) uint8 tensor over `storage` (no copy)."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class SleepingWeights:
    def __init__(self, model: torch.nn.Module, level: int):
        """Release every tensor of `model` now: level 1 writes its bytes to a temporary file first, level 2 keeps
        nothing."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 or 2, got {level!r}")
        self.level = level
        self.storages = _storages(model_tensors(model))
        self.nbytes = sum(s.nbytes for s in self.storages)
        self.file = tempfile.TemporaryFile() if level == 1 else None
        with torch.no_grad():
            for s in self.storages:
                if self.file is not None:
                    _as_bytes(s.views[0][1].untyped_storage()).cpu().numpy().tofile(self.file)
                for _, t, *_ in s.views:
                    t.set_(torch.empty(0, dtype=t.dtype, device=t.device))  # the last reference: the memory is free

    def wake(self, loader=None) -> None:
        """Give every tensor its storage back: level 1 from the file, level 2 from `loader()`, a model of the same
        structure built again (ValueError, and still asleep, if it does not match). Then the file is closed."""
        sources = self._read_file() if self.file is not None else self._take_from(loader())
        with torch.no_grad():
            for s, storage in zip(self.storages, sources):
                for _, t, offset, size, stride in s.views:
                    t.set_(storage, offset, size, stride)
        self.close()

    def _read_file(self) -> list[torch.UntypedStorage]:
        self.file.seek(0)
        sources = []
        for s in self.storages:
            data = np.fromfile(self.file, dtype=np.uint8, count=s.nbytes)
            if data.size != s.nbytes:
                raise ValueError(f"the sleep file ended after {data.size} of {s.nbytes} bytes of {s.views[0][0]}")
            sources.append(torch.from_numpy(data).to(s.views[0][1].device).untyped_storage())
        return sources

    def _take_from(self, model: torch.nn.Module) -> list[torch.UntypedStorage]:
        """The storages of the rebuilt model's tensors, matched by name, each checked against what slept."""
        fresh = model_tensors(model)
        sources = []
        for s in self.storages:
            storage = fresh[s.views[0][0]].untyped_storage() if s.views[0][0] in fresh else None
            for name, t, offset, size, stride in s.views:
                new = fresh.get(name)
                if storage is None or new is None or storage.nbytes() != s.nbytes or \
                        new.untyped_storage().data_ptr() != storage.data_ptr() or \
                        (new.dtype, new.storage_offset(), tuple(new.shape), new.stride()) != (t.dtype, offset, size, stride):
                    raise ValueError(f"the model built again does not match the one that slept at {name} (was the "
                                     "model file replaced by another model?)")
            sources.append(storage)
        return sources

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None
