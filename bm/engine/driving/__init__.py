"""Driving the core: the one :class:`~bm.engine.driving.driver.Driver` (admit, step, route responses and
stats, stop), the engine loop that runs it on a worker thread behind the Batch Manager's callbacks, and
the worker thread's control surface. The top of the engine."""
