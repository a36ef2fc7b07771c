"""Dynamic batching: the event loop's side (batcher), the queue's policy (queue: clients' turns, the token bound and
budget, push-out), the engine's thread and its retries (engine_thread), and the sentences in flight on an engine,
advanced a window of positions at a time (in_flight)."""
