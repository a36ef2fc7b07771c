"""Dynamic batching: the policy (batcher: the queue, clients' turns, the token budget) and the sentences in flight
on an engine, advanced a window of positions at a time (in_flight)."""
