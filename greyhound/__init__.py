"""Greyhound: find and fix fail-slows and hangs in distributed training."""
