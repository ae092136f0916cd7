"""The compute axes of a curve: one home for every command that names them."""

COMPUTE_AXES = ("gpu_hours", "flops", "tokens", "device_seconds", "step")
"""The x axes a curve can be fitted on: an eval point's cumulative compute counters, or its step."""
MEASURED_COMPUTE_AXES = COMPUTE_AXES[:-1]
"""The ones that measure compute (not `step`): what status shows and what imports may carry."""
