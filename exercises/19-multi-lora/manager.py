"""Exercise 19.3 — the adapter slots' LRU: which adapter leaves a slot when a step needs a new one.

This file mirrors nanoserve/lora/manager.py. The LoRAModelManager below is the reference's, except that it
assigns slots with your `lru_slots`: the manager then writes each adapter you return into its slot (reading it
from memory, or from disk first) and points the step's tokens at the slots.

    max_loras = 2; steps asking {a}, {a, b}, {b, c}:
      {a}      -> {a: 1}       slots {a: 1}
      {a, b}   -> {b: 2}       slots {a: 1, b: 2}
      {b, c}   -> {c: 1}       slots {b: 2, c: 1}        a was the least recently used, and not needed

Graded with `make grade CH=19`. README.md has the questions to answer first.
"""

from collections import OrderedDict

from nanoserve.lora.manager import LoRAModelManager as ReferenceLoRAModelManager


def lru_slots(slots: OrderedDict, names: set[str], max_loras: int) -> dict[str, int]:
    """Exercise 19.3: give every adapter of `names` a slot in 1..max_loras; returns {name: slot} of those that
    must be written into their slot now (the ones that had none). `slots` (name -> slot, least recently used
    first) is updated in place: every name of `names` ends up in it, most recently used last — the ones already
    there moved to the end, the new ones after them in sorted order; a new one takes the smallest free slot,
    or evicts the least recently used adapter that is not in `names`. len(names) <= max_loras.

        slots {a: 1, b: 2}, names {b, c}, max_loras 2  ->  returns {c: 1}; slots {b: 2, c: 1}
    """
    raise NotImplementedError("Exercise 19.3: write lru_slots (see its docstring and README.md)")


class LoRAModelManager(ReferenceLoRAModelManager):
    assign_slots = staticmethod(lru_slots)
