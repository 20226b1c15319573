"""The runtime: NVRTC compilation, the device and the caller's stream, input checks, and one kernel class per
family that launches its compiled kernel."""
