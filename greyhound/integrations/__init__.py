"""Adapters a training framework calls to apply Greyhound's plans; none imports its framework
until used, so importing greyhound never needs PyTorch or Megatron."""
