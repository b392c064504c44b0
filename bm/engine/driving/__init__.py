"""Driving the core: the one :class:`~bm.engine.driving.driver.Driver` (admit, step, route responses and
stats, stop), the engine loop that runs it on a worker thread behind the Batch Manager's callbacks, the
worker thread's control surface, and the one client layer a caller talks to the loop through
(:mod:`~bm.engine.driving.client`). The top of the engine."""
