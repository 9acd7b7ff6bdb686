"""The RQ and Redis side of a worker: its RQ worker, the engine thread, the publisher, start-up."""
