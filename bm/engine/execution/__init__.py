"""The executor side of the core: the protocol (the batch the core hands to whatever computes tokens, and
the result it gets back), a fake executor without a model, and the bookkeeping of the executor's LoRA
adapter slots (the PEFT cache). Imports only :mod:`bm.engine.requests` of the engine."""
