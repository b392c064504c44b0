"""The core loop: :class:`~bm.engine.step.core.EngineCore`'s iteration (schedule, pause, prepare resources,
execute, update, respond, stats) and the steps it delegates: setup and limits before the first step,
admission and head-of-line watch, the batch from the plan, applying a step's tokens, overlap scheduling,
fast-forwarded steady decode. Imports no driver (:mod:`bm.engine.driving` runs it)."""
