"""Accelerator processes: `python -m workers --model NAME` loads one model and serves its queue."""
