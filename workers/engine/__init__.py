"""Engine adapters: one interface (``base.Engine``), the real vLLM engine and an instant engine."""
