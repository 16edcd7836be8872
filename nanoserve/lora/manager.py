"""Chapter 19 — adapters as a tier: slots in the step, memory, disk; least recently used goes first.

    disk  every adapter registered (its directory)                  load: read + check the safetensors file
    cpu   at most max_cpu_loras adapters (slots included), read        load: a copy into the layers' slot
    slot  at most max_loras, in the LoRA layers' weights               a step gathers from these only

A step asks for its adapters (`set_step`); one already in a slot costs nothing, one in memory is copied into
a free slot or the least recently used slot that this step does not need, one on disk is read first (and
pushes the least recently used adapter out of memory). A step never needs more than max_loras adapters: the
scheduler admits no request whose adapter would be one too many (Scheduler.lora_fits).

    max_loras = 2, steps asking {a}, {a, b}, {b, c}:
      {a}      slot 1 <- a                    slots (LRU first): a
      {a, b}   slot 2 <- b                    a, b
      {b, c}   c evicts a (LRU, not needed)   b, c
"""

import time
from collections import OrderedDict

from nanoserve.engine.config import LORA_MODULES, LoRAConfig
from nanoserve.lora.adapter import LoRAAdapter, load_adapter
from nanoserve.lora.layers import LoRALinear, LoRAMapping, add_lora_layers


def lru_slots(slots: OrderedDict, names: set[str], max_loras: int) -> dict[str, int]:
    """Exercise 19.3: give every adapter of `names` a slot in 1..max_loras; returns {name: slot} of those that
    must be written into their slot now (the ones that had none). `slots` (name -> slot, least recently used
    first) is updated in place: every name of `names` ends up in it, most recently used last — the ones already
    there moved to the end, the new ones after them in sorted order; a new one takes the smallest free slot,
    or evicts the least recently used adapter that is not in `names`. len(names) <= max_loras.

        slots {a: 1, b: 2}, names {b, c}, max_loras 2  ->  returns {c: 1}; slots {b: 2, c: 1}
    """
    for name in sorted(names & set(slots)):
        slots.move_to_end(name)
    new = {}
    for name in sorted(names - set(slots)):
        free = set(range(1, max_loras + 1)) - set(slots.values())
        slot = min(free) if free else slots.pop(next(n for n in slots if n not in names))
        slots[name] = new[name] = slot
    return new


class LoRAModelManager:
    assign_slots = staticmethod(lru_slots)  # the eviction policy (exercise 19.3 gives its own)

    def __init__(self, model, config: LoRAConfig, load=load_adapter, punica=None):
        """Adds LoRA layers to `model` (in place). load(name, path, model_config, max_rank, modules) -> LoRAAdapter;
        punica: the module whose bgmv and sgmv the layers call (default nanoserve.lora.punica; the learner's,
        exercises 19.1 and 19.2, under --student 19)."""
        self.config = config
        self.model_config = model.config
        self.load = load
        self.mapping = LoRAMapping(punica)
        self.layers = self.add_layers(model)
        self.paths: dict[str, str] = {}  # name -> directory: every adapter known (the disk tier)
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: OrderedDict[str, int] = OrderedDict()  # name -> slot in 1..max_loras, least recently used first
        self.load_seconds = {"disk": [], "slot": []}  # seconds of each read from disk, each copy into a slot

    def add_layers(self, model) -> dict[str, LoRALinear]:
        """Wrap `model`'s projections in this manager's LoRA layers (its modules, max_loras and max_lora_rank): the
        model it was built with, or one built again for a level-2 wake (chapter 19's sleep), whose tensors must
        carry the same names and shapes as those that slept."""
        c = self.config
        return add_lora_layers(model, c.modules, c.max_loras, c.max_lora_rank, self.mapping)

    # ---- the registry ----------------------------------------------------------------------------
    def add_adapter(self, name: str, path: str) -> LoRAAdapter:
        """Register an adapter, reading and checking it now (a bad one fails here, not in a step)."""
        if name in self.paths:
            raise ValueError(f"adapter {name!r} is already loaded")
        adapter = self._read(name, path)
        self.paths[name] = str(path)
        self._keep_in_memory(adapter)
        return adapter

    def remove_adapter(self, name: str) -> None:
        if name not in self.paths:
            raise KeyError(name)
        del self.paths[name]
        self.cpu.pop(name, None)
        self.slots.pop(name, None)  # the slot is free; its stale weights are overwritten by the next adapter

    def forget_slots(self) -> None:
        """The slots' weights were dropped (chapter 19's sleep, level 2): every adapter is copied in again when a
        step needs it (from memory, or disk first)."""
        self.slots.clear()

    def list_adapters(self) -> list[str]:
        return list(self.paths)

    # ---- the step ----------------------------------------------------------------------------------
    def set_step(self, rows: list[tuple[str | None, int]]) -> None:
        """rows: (adapter name or None, num_tokens) per sequence, in the batch's order. Puts the adapters into
        slots and points the LoRA layers at them."""
        slots = self.activate({name for name, _ in rows if name is not None})
        device = next(iter(self.layers.values())).lora_a.device
        self.mapping.set([(slots.get(name, 0), n) for name, n in rows], device)

    def end_step(self) -> None:
        self.mapping.clear()

    def activate(self, names: set[str]) -> dict[str, int]:
        """Give each adapter of `names` a slot; returns {name: slot}."""
        if len(names) > self.config.max_loras:
            raise RuntimeError(f"a step needs {len(names)} adapters, max_loras is {self.config.max_loras}")
        for name, slot in self.assign_slots(self.slots, names, self.config.max_loras).items():
            self._write_slot(slot, self._in_memory(name))
        return {name: self.slots[name] for name in names}

    # ---- tiers ---------------------------------------------------------------------------------------
    def _read(self, name: str, path: str) -> LoRAAdapter:
        start = time.perf_counter()
        adapter = self.load(name, path, self.model_config, self.config.max_lora_rank, self.config.modules)
        self.load_seconds["disk"].append(time.perf_counter() - start)
        return adapter

    def _in_memory(self, name: str) -> LoRAAdapter:
        if name not in self.cpu:
            self._keep_in_memory(self._read(name, self.paths[name]))
        self.cpu.move_to_end(name)
        return self.cpu[name]

    def _keep_in_memory(self, adapter: LoRAAdapter) -> None:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        # LRU first, never one in a slot: it is copied again whenever it is evicted and re-slotted. At most
        # max_loras <= max_cpu_loras adapters are in slots, so one outside them is always there to drop (it may
        # be the adapter just read: add_adapter checked it, and a step reads it again from disk).
        while len(self.cpu) > self.config.max_cpu_loras:
            del self.cpu[next(n for n in self.cpu if n not in self.slots)]

    def _write_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        start = time.perf_counter()
        for name, layer in self.layers.items():  # "layers.0.self_attn.qkv_proj"
            prefix, _, fused = name.rpartition(".")
            layer.set_slot(slot, [adapter.weights.get(f"{prefix}.{part}") for part in LORA_MODULES[fused]])
        self.load_seconds["slot"].append(time.perf_counter() - start)

    def slot_bytes(self) -> int:
        """Memory the slots take in every LoRA layer: (max_loras + 1) · R · (S·in + out) floats per layer."""
        return sum(t.numel() * t.element_size() for layer in self.layers.values() for t in (layer.lora_a, layer.lora_b))
