"""The extraction on the GPU: a shard's run (start-up, the forward loop, the finish), the model's load (read-
ahead, preload, kernel prewarm), the layer capture and its kernels, batching, the device-to-host copies and the
batch writer, liveness (STARTED, heartbeat, exit status), confinement, the host's self-report for the preflight,
and the synthetic worker that runs no model."""
