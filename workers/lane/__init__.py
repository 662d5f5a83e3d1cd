"""The batch lane: batch lines run through a shared real-time server, inside its latency targets."""
